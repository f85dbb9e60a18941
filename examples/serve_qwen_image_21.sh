#!/usr/bin/env bash
# Serve Qwen-Image-2.1 through vllm-omni's diffusers adapter with the plugin's prefix-KV graphs.
#
#   pip install vllm-omni==0.30.0 vllm==0.30.0 vllm-omni-graphdecode
#   pip install --no-deps diffusers==0.42.1     # vllm-omni pins 0.40.0; 2.1 needs >= 0.41
#   bash examples/serve_qwen_image_21.sh [MODEL]
set -euo pipefail
model=${1:-Qwen/Qwen-Image-2.1}
export VLLM_OMNI_GRAPHDECODE=qwen_image_21
# vllm-omni 0.26's diffusers adapter otherwise picks diffusers' "_native_flash" backend, which
# rejects the attention mask Qwen-Image-2.1 passes: the engine's warm-up fails (seen on an H200).
export DIFFUSION_ATTENTION_BACKEND=${DIFFUSION_ATTENTION_BACKEND:-TORCH_SDPA}
# The adapter rejects TP>1, CFG-parallel, SP, cache backends and --enforce-eager.
exec vllm serve "$model" --omni --diffusion-load-format diffusers --max-num-seqs 8 \
  --port "${PORT:-8000}"
