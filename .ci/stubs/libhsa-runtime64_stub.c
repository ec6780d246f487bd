/* libhsa-runtime64.so.1 stand-in for the ROCm wheel. Debian 12's libhsa-runtime64-1 is ROCm 5.2, older than
 * the wheel's ROCm 7 build (it pairs with libamdhip64.so.7, which Debian lacks), so both are stubbed.
 * Both functions report HSA_STATUS_ERROR_NOT_INITIALIZED (0x100B). Symbol version ROCR_1. */
#include "stub.h"

STUB_CODE(hsa_amd_portable_export_dmabuf, 0x100B)
STUB_CODE_MESSAGE(hsa_status_string, 0x100B)
