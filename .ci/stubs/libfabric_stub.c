/* libfabric.so.1 stand-in for the EFA wheels. Debian 12 has libfabric1, but it depends on
 * ibverbs-providers, which would install a real libmlx5.so.1 system-wide; the matrix keeps every stand-in
 * inside its own venvs (docs/native-client.md, "Wheel matrix"), so this one is stubbed too.
 * fi_getinfo fails with -FI_ENODATA (-61: no provider), fi_fabric with -FI_ENOSYS (-38); fi_dupinfo and
 * fi_strerror return NULL; fi_freeinfo (void in the real library) returns -38, which callers ignore. */
#include "stub.h"

STUB_CODE(fi_getinfo, -61)
STUB_CODE(fi_fabric, -38)
STUB_NULL(fi_dupinfo)
STUB_CODE(fi_freeinfo, -38)
STUB_NULL(fi_strerror)
