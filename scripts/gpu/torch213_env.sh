# Sourced (by run_suite.sh and torch_session.sh) for a run of the 0.30 stack on torch 2.13, the
# torch vllm 0.30 pins, from the .gpu-bundle-torch-N folders (build_torch_bundle.py) instead of
# the host's 2.11. Needs $site (the bundle's /tmp/site); sets $torch_site and $omni_site (the
# 0.30 tree to put on PYTHONPATH) and exports what torch 2.13 needs on this host:
# - LD_PRELOAD of nccl_compat.c's library: the host's NCCL is 2.28.9, and torch 2.13 references
#   eight NCCL 2.29 functions (nothing in a one-GPU run calls them);
# - PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1: torch's own check refuses the host's cuDNN 9.19 for
#   a torch built against 9.20, although every cuDNN function torch references is in 9.19.
# vllm 0.30's FA2 built for 2.13 is laid over a hard-linked copy of the 0.30 tree (whose FA2, the
# one the bundle carries for 2.11, does not load on 2.13).
torch_site=${GRAPHDECODE_TORCH_SITE:-/tmp/site-torch-2.13.0}
if [ ! -d "$torch_site/torch" ]; then
  echo "torch 2.13: no torch in $torch_site (carry every .gpu-bundle-torch-N first)" >&2
  return 1
fi
omni_site=$site-omni-0.30.0
_fa2=vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so
if [ -f "$torch_site/overlay-omni-0.30.0/$_fa2" ] && [ ! -d "$omni_site-torch2.13" ]; then
  rm -rf "$omni_site-torch2.13.tmp"
  cp -al "$omni_site" "$omni_site-torch2.13.tmp" && rm -f "$omni_site-torch2.13.tmp/$_fa2" \
    && cp "$torch_site/overlay-omni-0.30.0/$_fa2" "$omni_site-torch2.13.tmp/$_fa2" \
    && mv "$omni_site-torch2.13.tmp" "$omni_site-torch2.13"
fi
[ -d "$omni_site-torch2.13" ] && omni_site=$omni_site-torch2.13
export LD_PRELOAD="$torch_site/libnccl_compat.so${LD_PRELOAD:+:$LD_PRELOAD}"
export PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1
