#!/usr/bin/env bash
# The two graph-pool designs that hung vllm-omni 0.30's in-tree decode, as cuda_graphs.py files
# for scripts/gpu/verify_session.sh v5 (git-ignored folder .gpu-bundle-variants, carried to the
# GPU host, whose copy of the tree has no usable git history):
#   own_pool.py            afe243c's: the plugin's graphs in a private pool, vLLM's global pool
#                          holding one anchor graph (the design that ran in h200-2026-12-02)
#   own_pool_no_anchor.py  the same without the anchor in vLLM's pool
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
out=$here/.gpu-bundle-variants
mkdir -p "$out"
git -C "$here" show afe243c:vllm_omni_graphdecode/cuda_graphs.py >"$out/own_pool.py"
grep -v '^            _pin_vllm_pool(where)$' "$out/own_pool.py" >"$out/own_pool_no_anchor.py"
if cmp -s "$out/own_pool.py" "$out/own_pool_no_anchor.py"; then
  echo "build_pool_variants: the anchor line was not found in afe243c's cuda_graphs.py" >&2
  exit 1
fi
ls -l "$out"
