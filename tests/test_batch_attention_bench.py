"""``benchmarks/attention_kernels.py``'s batched-step attention case (``bench.py --cases
batch_attention``, issue #42): its K/V layout, tables and fp32 reference, checked on CPU against
the plugin's own paged reference at every page size the case times. The kernel's timings come
from the H200."""

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import attention_kernels as ak  # noqa: E402

from vllm_omni_graphdecode.ops import attention as attention_ops  # noqa: E402


@pytest.fixture()
def layers(monkeypatch):
    monkeypatch.setattr(ak, "LAYERS", 1)
    return ak._BatchLayers(64, "cpu", seed=3)


@pytest.mark.parametrize("page", [16, 32, 64])
def test_each_page_size_gives_each_active_row_its_own_keys_and_idle_rows_one(layers, page):
    table, seqused = layers.table(page, active=8)
    k = layers.k[0].view(-1, page, ak.KV_HEADS, ak.HEAD_DIM)
    v = layers.v[0].view(-1, page, ak.KV_HEADS, ak.HEAD_DIM)
    out = attention_ops.reference_paged_attention(
        layers.q[0], k, v, max_seqlen_q=1, cu_seqlens_q=None, max_seqlen_k=layers.ctx,
        seqused_k=seqused, block_table=table, softmax_scale=layers.scale)
    assert seqused.tolist() == [64] * 8 + [1] * 8
    torch.testing.assert_close(out[0].float(), layers.reference_row0(0), atol=1e-2, rtol=0)
    # Rows own disjoint blocks past the scratch tokens; an idle row reads the first key alone.
    used = table[:8].flatten().tolist()
    assert len(set(used)) == len(used) and min(used) * page >= ak.SCRATCH_TOKENS
    group = ak.Q_HEADS // ak.KV_HEADS
    first_value = layers.v[0][0].repeat_interleave(group, dim=0)
    assert torch.equal(out[8], first_value.to(out.dtype))


def test_a_row_sees_the_same_keys_at_every_page_size(layers):
    outs = []
    for page in (16, 32, 64):
        table, seqused = layers.table(page, active=16)
        k = layers.k[0].view(-1, page, ak.KV_HEADS, ak.HEAD_DIM)
        v = layers.v[0].view(-1, page, ak.KV_HEADS, ak.HEAD_DIM)
        outs.append(attention_ops.reference_paged_attention(
            layers.q[0], k, v, max_seqlen_q=1, cu_seqlens_q=None, max_seqlen_k=layers.ctx,
            seqused_k=seqused, block_table=table, softmax_scale=layers.scale))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[2])


def test_page_sizes_that_do_not_fit_are_refused_by_name():
    import types

    args = types.SimpleNamespace(batch_splits="16", batch_pages="16,48", contexts=[2048])
    with pytest.raises(ValueError, match=r"\[16, 48\].*accepted: page sizes that divide 64 "
                                         r"and every context"):
        ak.bench_batch_attention(args, [], {}, print)


_INTERPRETED = r"""
import importlib, json, sys
import vllm.triton_utils.importing as importing
importing.HAS_TRITON = True  # no GPU driver here: vLLM would hand its modules placeholders
import vllm.triton_utils
importlib.reload(vllm.triton_utils)
sys.path.insert(0, sys.argv[1])
import attention_kernels as ak
from vllm.v1.attention.ops.triton_decode_attention import decode_attention_fwd
ak.LAYERS = 1
layers = ak._BatchLayers(32, "cpu", seed=5)
for name in ("k", "v", "q"):  # Triton's interpreter computes bf16 wrongly on CPU; fp32 is exact
    setattr(layers, name, [t.float() for t in getattr(layers, name)])
result = {}
for page in (16, 32):
    alone = ak._batch_call(decode_attention_fwd, layers, page, 2, 8)(0).clone()
    beside = ak._batch_call(decode_attention_fwd, layers, page, 2, 16)(0)
    result[page] = {"diff": float((alone[0] - layers.reference_row0(0)).abs().max()),
                    "same": bool((alone[0] == beside[0]).all())}
print("RESULT " + json.dumps(result))
"""


def test_the_cases_call_runs_vllms_own_kernel_right_under_tritons_interpreter():
    """The very call the case times on the H200 (``_batch_call``: vLLM's Triton decode kernel
    over this layout and table), run by Triton's interpreter on CPU tensors: row 0 equals fp32
    attention over its own keys, and is bit for bit the same beside 8 or 16 decoding rows."""
    import json
    import subprocess

    proc = subprocess.run([sys.executable, "-c", _INTERPRETED, os.path.join(ROOT, "benchmarks")],
                          capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    for page in ("16", "32"):
        assert result[page]["diff"] < 1e-5 and result[page]["same"], result
