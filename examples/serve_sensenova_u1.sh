#!/usr/bin/env bash
# Serve SenseNova-U1 with the plugin's paged decode + CUDA graphs (vllm-omni 0.24-0.28), or with
# vllm-omni 0.30's own in-tree paged decode (the plugin defers to it by default).
#
#   pip install vllm-omni==0.28.0 vllm==0.28.0 vllm-omni-graphdecode
#   bash examples/serve_sensenova_u1.sh [MODEL]
set -euo pipefail
model=${1:-sensenova/SenseNova-U1-8B-MoT}
export VLLM_OMNI_GRAPHDECODE=sensenova_u1
# Capture the 512-2048 buckets at load so the first think request pays no capture.
export VLLM_OMNI_GRAPHDECODE_PRECAPTURE=1
# With an allow-list set, name vllm-omni's own plugin and this one:
# export VLLM_PLUGINS=vllm_omni_register_models,vllm_omni_graphdecode
# MAX_NUM_SEQS=8 serves up to 8 requests together (vllm-omni 0.28/0.30): their decode runs as rows
# of one batched step; vLLM-Omni's admission wait lets requests sent together arrive before the
# engine starts a forward on the first one.
batch=()
if [ "${MAX_NUM_SEQS:-1}" -gt 1 ]; then
  batch=(--max-num-seqs "$MAX_NUM_SEQS" --request-batch-max-wait-ms 100)
fi
exec vllm serve "$model" --omni --port "${PORT:-8000}" ${batch[@]+"${batch[@]}"}
