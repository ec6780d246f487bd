/* Shared macros for the import stubs (docs/native-client.md, "Wheel matrix").
 *
 * Every stub function ignores its arguments and fails: nothing here pretends a device, a driver or a
 * fabric exists. Three shapes, each on one line so tests/test_ci_stubs.py can read the table back:
 *   STUB_CODE(name, code)           returns the (non-zero) error code `code`.
 *   STUB_NULL(name)                 returns NULL (the real function returns a pointer).
 *   STUB_CODE_MESSAGE(name, code)   returns `code`; its second argument is a `const char **` out-parameter
 *                                   (an error-string query), set to a fixed message when it is not NULL, so
 *                                   a caller that prints it without checking the code reads text, not junk.
 * A function whose real counterpart returns void is a STUB_CODE too: the caller ignores the value.
 */
#ifndef KVADDR_CI_STUB_H
#define KVADDR_CI_STUB_H

#define STUB_EXPORT __attribute__((visibility("default")))

#define STUB_CODE(name, code)                     \
    STUB_EXPORT long name(void);                  \
    STUB_EXPORT long name(void) { return (code); }

#define STUB_NULL(name)                           \
    STUB_EXPORT void *name(void);                 \
    STUB_EXPORT void *name(void) { return 0; }

#define STUB_CODE_MESSAGE(name, code)                                                  \
    STUB_EXPORT long name(long ignored, const char **message);                         \
    STUB_EXPORT long name(long ignored, const char **message) {                        \
        (void)ignored;                                                                 \
        if (message != 0) *message = "mooncake_kvaddr CI stub: no such device here";   \
        return (code);                                                                 \
    }

#endif
