/* The eight NCCL 2.29 entry points that torch 2.13's libtorch_cuda.so references and the GPU
 * host's NCCL 2.28.9 (torch 2.11's) does not export. torch 2.13 pins nvidia-nccl-cu13 2.29.7,
 * whose libnccl.so.2 is 141 MB even xz-compressed and trimmed to sm_90: three device calls of
 * transfer on its own. Python imports torch with RTLD_NOW, so a missing symbol fails the import
 * even where nothing calls it. Preloaded (LD_PRELOAD) beside the host's NCCL, these definitions
 * let torch 2.13 load; each returns ncclInvalidUsage and says so on stderr if it is ever called.
 * Nothing in a one-GPU run calls them: communicator suspend/resume, memory statistics and the
 * device-initiated signal/put and multimem pointer APIs. Built by build_torch_bundle.py.
 */
#include <stdio.h>

#define NCCL_INVALID_USAGE 5

#define MISSING(name)                                                                  \
  int name(void) {                                                                   \
    fprintf(stderr, "nccl_compat: %s is not in this host's NCCL (2.28.9); torch 2.13 " \
                    "pins 2.29.7\n", #name);                                          \
    return NCCL_INVALID_USAGE;                                                       \
  }

MISSING(ncclCommMemStats)
MISSING(ncclCommResume)
MISSING(ncclCommSuspend)
MISSING(ncclGetLsaMultimemDevicePointer)
MISSING(ncclGetPeerDevicePointer)
MISSING(ncclPutSignal)
MISSING(ncclSignal)
MISSING(ncclWaitSignal)
