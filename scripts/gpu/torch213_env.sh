# Sourced (by run_suite.sh, and so by run.py's torch 2.13 steps) for a run of the 0.30 stack
# on torch 2.13, the torch vllm 0.30 pins, from the .gpu-bundle-torch-N folders
# (build_torch_bundle.py) instead of the host's 2.11. Needs $site (the bundle's /tmp/site); sets
# $torch_site and $omni_site (the 0.30 tree to put on PYTHONPATH) and exports what torch 2.13
# needs on this host, which keeps its own NCCL, cuDNN and triton:
# - LD_PRELOAD of nccl_compat.c's library: the host's NCCL is 2.28.9, and torch 2.13 references
#   eight NCCL 2.29 functions; nothing in a one-GPU run calls them (torch.cuda.nccl.version()
#   reports the 2.29.7 torch was built against, not the library loaded). Multi-GPU runs on this
#   stack are not covered: they would run NCCL 2.28.9 under a torch built for 2.29.
# - PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1: torch's own check refuses the host's cuDNN 9.19 for
#   a torch built against 9.20, although every cuDNN function torch references is in 9.19.
# - triton stays the host's 3.6 (torch 2.13 pins 3.7.1): Inductor compiled and ran with it
#   (h200-2026-12-02b, torch-2.13/tt2-torch-check.log).
# vllm 0.30's FA2 built for 2.13 is laid over a hard-linked copy of the 0.30 tree (whose FA2, the
# one the bundle carries for 2.11, does not load on 2.13); the copy is made again whenever the
# tree or the overlay was unpacked anew.
torch_site=${GRAPHDECODE_TORCH_SITE:-/tmp/site-torch-2.13.0}
if [ ! -f "$torch_site/.bundle-state.json" ]; then
  echo "torch 2.13: $torch_site is not unpacked (carry every .gpu-bundle-torch-N first)" >&2
  return 1
fi
omni_site=$site-omni-0.30.0
_fa2=vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so
if [ -f "$torch_site/overlay-omni-0.30.0/$_fa2" ]; then
  _stamp=$(cat "$site/.bundle-state.json" "$torch_site/.bundle-state.json" 2>/dev/null | cksum)
  if [ "$(cat "$omni_site-torch2.13/.source-stamp" 2>/dev/null)" != "$_stamp" ]; then
    rm -rf "$omni_site-torch2.13" "$omni_site-torch2.13.tmp"
    cp -al "$omni_site" "$omni_site-torch2.13.tmp" && rm -f "$omni_site-torch2.13.tmp/$_fa2" \
      && cp "$torch_site/overlay-omni-0.30.0/$_fa2" "$omni_site-torch2.13.tmp/$_fa2" \
      && echo "$_stamp" >"$omni_site-torch2.13.tmp/.source-stamp" \
      && mv "$omni_site-torch2.13.tmp" "$omni_site-torch2.13"
  fi
fi
if [ -f "$omni_site-torch2.13/.source-stamp" ]; then
  omni_site=$omni_site-torch2.13
else
  echo "torch 2.13: no FA2 built for it laid over $omni_site; vllm-omni 0.30's in-tree decode" \
    "will not find FA2 (rebuild the torch bundle)" >&2
fi
export LD_PRELOAD="$torch_site/libnccl_compat.so${LD_PRELOAD:+:$LD_PRELOAD}"
export PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1
