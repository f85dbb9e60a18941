#!/usr/bin/env bash
# Set up the pinned environment (first run: several minutes) and run the demo: tiny real
# SenseNova-U1 and Qwen-Image-2.1 models, random weights, through the plugin.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
venv=$("$here/scripts/setup_env.sh" | tail -n 1)
cd "$here"
exec "$venv/bin/python" -m vllm_omni_graphdecode demo "$@"
