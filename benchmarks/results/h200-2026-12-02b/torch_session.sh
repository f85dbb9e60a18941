#!/usr/bin/env bash
# A record: this ran as scripts/gpu/torch_session.sh for the session of this folder (its README).
# It sourced scripts/gpu/session_common.sh (its last version: h200-2026-12-03c/); a new
# session runs scripts/gpu/run.py instead (scripts/gpu/README.md).
# One device session: the 0.30 stack on the torch vllm 0.30 pins (2.13, build_torch_bundle.py,
# torch213_env.sh) instead of the host's 2.11, after vLLM's FA2 is warmed, and the restored graph
# pool with the two capture fixes of afe243c on both stacks. Calls back to back on one machine (a
# machine goes back after 30 s idle), each result packed into $OUT/results-STEP.tgz:
#
#   scripts/gpu/torch_session.sh t1   # .gpu-bundle: 0.26, the decode file
#   scripts/gpu/torch_session.sh t2   # .gpu-bundle-2 arrives (unpacked)
#   scripts/gpu/torch_session.sh t3   # .gpu-bundle-3 arrives; FA2 warms in the background
#                                     # (scripts/gpu/warm_fa2.py), for every later step
#   scripts/gpu/torch_session.sh tt   # one .gpu-bundle-torch-N each; once torch 2.13 and the
#                                     # 0.30 tree are both there, they are checked: a matmul,
#                                     # cuDNN, one Inductor compile (the host's triton 3.6), a
#                                     # graph; then the 0.30 bundle's check (vllm's kernels,
#                                     # a tiny SenseNova-U1 decode, FA2, the in-tree kernel)
#   scripts/gpu/torch_session.sh t4   # 0.30 on torch 2.13 (2.11 if tt's check failed): the
#                                     # decode file, the batch file
#   scripts/gpu/torch_session.sh t5   # .gpu-bundle-serve*: the engine file on the same torch;
#                                     # one FP8 think request on 2.11 (the figure it confirms
#                                     # was measured there)
#   scripts/gpu/torch_session.sh te   # the engine file on torch 2.13
#
# h200-2026-12-02b is what it brought back. Machine 1: t1, t2, t3, tt x3 (a first bundle of
# torch alone, whose check failed), t4 and t5 on 2.11, then two suites inline (0.26 batch, 0.30
# FP8). Machine 2: t2 with .gpu-bundle, -2 and -3; tt with each of the five .gpu-bundle-torch-N
# (the check passed); te with .gpu-bundle-serve*, cut by the device time left
# (scripts/gpu/evaluate_engine_runs.py evaluated its runs).
# Build first (git-ignored): scripts/gpu/build_bundle.sh, scripts/gpu/build_serving_bundle.sh,
# scripts/gpu/build_torch_bundle.py.
set -uo pipefail
what=${1:?usage: torch_session.sh t1|t2|t3|tt|t4|t5|te}
source "$(dirname "$0")/session_common.sh"
torch_site=/tmp/site-torch-2.13.0
# t4/t5 run on torch 2.13 only where tt's check passed on this machine.
torch_ok() { [ -f /tmp/torch-2.13-ok ]; }
case "$what" in
  t1)
    unpack
    suite 200 suite-0.26-decode tests/test_sensenova_gpu.py -q -rfE --durations=20
    ;;
  t2)
    unpack
    ;;
  t3)
    unpack
    PYTHONPATH=$py30 setsid nohup python3 scripts/gpu/warm_fa2.py >/tmp/warm-fa2.log 2>&1 &
    sleep 2
    ;;
  tt)
    unpack
    cp /tmp/warm-fa2.log "$res/" 2>/dev/null
    if [ -f "$torch_site/.bundle-state.json" ] && [ -d /tmp/site-omni-0.30.0 ]; then
      site=/tmp/site
      source scripts/gpu/torch213_env.sh
      pp=$torch_site:$here:/tmp/site-project:$omni_site:$site
      PYTHONPATH=$pp timeout 240 python3 - >"$res/torch-check.log" 2>&1 <<'PY'
import json, time
import torch
import ctypes
loaded = ctypes.c_int()
ctypes.CDLL("libnccl.so.2").ncclGetVersion(ctypes.byref(loaded))  # the library in the process
print("torch", torch.__version__, torch.__file__, "cuda", torch.version.cuda,
      "cudnn", torch.backends.cudnn.version(), "nccl built", torch.cuda.nccl.version(),
      "loaded", loaded.value, flush=True)
import torchvision, triton
print("torchvision", torchvision.__version__, "triton", triton.__version__, flush=True)
x = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
ok = {"matmul": float((x @ x).float().abs().max())}
conv = torch.nn.Conv2d(3, 8, 3).cuda()
ok["cudnn_conv"] = list(conv(torch.randn(1, 3, 16, 16, device="cuda")).shape)
t = time.perf_counter()
f = torch.compile(lambda a: torch.nn.functional.silu(a) * a + 1)
ok["inductor_maxdiff"] = float((f(x) - (torch.nn.functional.silu(x) * x + 1)).abs().max())
ok["inductor_s"] = round(time.perf_counter() - t, 1)
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    y = x @ x
g.replay()
ok["graph"] = float((y - x @ x).abs().max())
print(json.dumps(ok), flush=True)
PY
      stamp torch-check
      # The 0.30 stack's own check: vllm's ops and FA3, a tiny SenseNova-U1 prefill + decode,
      # FA2 (its first call compiles its PTX: this warms it for later steps) and vllm-omni's
      # in-tree decode kernel.
      checks=env,import_vllm_C_ext,import_vllm,current_platform,vllm_C_ops,vllm_fa3
      checks+=,import_vllm_omni,import_sensenova_pipeline,vllm_distributed_init,sensenova_lm_build
      checks+=,sensenova_lm_prefill_decode,vllm_fa2_paged_varlen,in_tree_paged_decode_kernel
      CHECK_ONLY=$checks PYTHONPATH=$pp timeout 240 python3 .gpu-bundle-3/check.py \
        >"$res/check-0.30-torch2.13.log" 2>&1
      stamp check-0.30-torch2.13
      grep -q '"graph"' "$res/torch-check.log" && touch /tmp/torch-2.13-ok
    fi
    ;;
  t4)
    export STACK=0.30
    torch_ok && export TORCH=2.13
    cp /tmp/warm-fa2.log "$res/" 2>/dev/null
    suite 230 suite-0.30-decode tests/test_sensenova_gpu.py -q -rfE --durations=20
    suite 220 suite-0.30-batch tests/test_sensenova_batch_gpu.py -q -rfE --durations=20
    ;;
  t5)
    export STACK=0.30
    if torch_ok; then export TORCH=2.13; fi
    GRAPHDECODE_E2E_TIMEOUT=170 suite 230 suite-0.30-engine tests/test_e2e_engine_gpu.py -q -rfE
    unset TORCH
    request 230 request-fp8-0.30 "$py30" --fp8 on
    ;;
  te)
    # The engine file on torch 2.13 only (the second machine of this session: t5 ran it on 2.11).
    export STACK=0.30 TORCH=2.13
    # Its limits were what the device time left allowed (the runs finished; pytest's assertions
    # did not start: scripts/gpu/evaluate_engine_runs.py).
    GRAPHDECODE_E2E_TIMEOUT=100 suite 128 suite-0.30-engine-torch2.13 tests/test_e2e_engine_gpu.py -q -rfE
    ;;
esac
finish
