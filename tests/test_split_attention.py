"""``ops/split_attention.py`` on the CPU, under Triton's interpreter: the plugin's split-K decode
attention against plain fp32 attention, batch invariance, and its one-launch combine. Its speed
against FA3 and vLLM's Triton kernel is ``bench.py --cases attention,batch_attention`` on a GPU."""

import pytest
import torch

from vllm_omni_graphdecode.ops import split_attention as sa

from test_fp8 import _run_interpreted

INTERPRETED = """
import torch
from vllm_omni_graphdecode.ops import split_attention as sa

g = torch.Generator().manual_seed(0)
rows, q_heads, kv_heads, d, page, blocks = 3, 8, 2, 32, 16, 40
k = torch.randn(blocks, page, kv_heads, d, generator=g).to(torch.bfloat16)
v = torch.randn(blocks, page, kv_heads, d, generator=g).to(torch.bfloat16)
q = torch.randn(rows, q_heads, d, generator=g).to(torch.bfloat16)
# Each row its own blocks in a shuffled order; lengths of one key, a partial page, whole pages.
table = (torch.randperm(blocks - 1, generator=g)[:rows * 8] + 1).view(rows, 8).int()
seqused = torch.tensor([1, 37, 128], dtype=torch.int32)
ref = sa.reference(q, k, v, table, seqused, d ** -0.5)
results = {}
for cfg in (sa.Config(splits=4, block_n=16), sa.Config(splits=4, block_n=16, one_launch=False),
            sa.Config(splits=8, block_n=32)):
    ws = sa.Workspace(rows, q_heads, kv_heads, d, cfg.splits, "cpu")
    out = sa.split_attention(q, k, v, table, seqused, d ** -0.5, ws, cfg)
    err = float((out.float() - ref.float()).abs().max())
    assert err <= 2 * 2.0 ** -8 * float(ref.float().abs().max()), (cfg, err)
    # The last program of each (row, KV head) put its count back: the next call starts at zero.
    assert not ws.counts.any(), ws.counts
    # Row 2 alone, in a call of one row: bit for bit its result beside the other two.
    alone = sa.split_attention(q[2:3], k, v, table[2:3], seqused[2:3], d ** -0.5,
                               sa.Workspace(1, q_heads, kv_heads, d, cfg.splits, "cpu"), cfg)
    assert torch.equal(alone[0], out[2]), cfg
    # Row 2 again with another neighbour length: unchanged.
    other = seqused.clone()
    other[0] = 100
    again = sa.split_attention(q, k, v, table, other, d ** -0.5, ws, cfg)
    assert torch.equal(again[2], out[2]), cfg
    results[cfg] = out
one, two = list(results.values())[:2]
assert torch.equal(one, two), "one launch and two launches combine alike"
print("ok")
"""


def test_interpreted_split_attention_matches_fp32_attention_and_is_batch_invariant():
    _run_interpreted(INTERPRETED)


def test_split_attention_refuses_shapes_it_does_not_take_naming_them():
    q = torch.zeros(1, 6, 32, dtype=torch.bfloat16)
    k = torch.zeros(4, 16, 4, 32, dtype=torch.bfloat16)
    ws = sa.Workspace(1, 6, 4, 32, 16, "cpu")
    table = torch.zeros(1, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"q \(1, 6, 32\).*multiple of KV heads"):
        sa.split_attention(q, k, k, table, torch.ones(1, dtype=torch.int32), 1.0, ws)
    q = torch.zeros(2, 8, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="workspace for"):
        sa.split_attention(q, k, k, table, torch.ones(2, dtype=torch.int32), 1.0, ws)


def test_split_attention_kernels_compile_for_hopper_on_this_cpu():
    """Both kernels, one launch and two, compiled by Triton down to an sm_90 cubin with no GPU:
    a kernel the interpreter runs but the compiler refuses would otherwise fail only on a GPU."""
    triton = pytest.importorskip("triton")
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as exc:
        pytest.skip(f"this Triton has no ahead-of-time compile API ({exc})")
    kernel, combine = sa._kernels()
    pointers = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "table_ptr": "*i32",
                "seqused_ptr": "*i32", "parts_ptr": "*fp32", "counts_ptr": "*i32",
                "out_ptr": "*bf16", "scale": "fp32"}
    strides = {name: "i32" for name in (
        "stride_qm", "stride_qh", "stride_kb", "stride_kt", "stride_kh", "stride_tm", "stride_pm",
        "stride_ph", "stride_ps", "stride_om", "stride_oh")}
    target = GPUTarget("cuda", 90, 32)
    for one_launch in (True, False):
        const = {"GROUP": 4, "HEADS": 16, "HEAD_DIM": 128, "PAGE": 16, "BLOCK_N": 64,
                 "SPLITS": 16, "ONE_LAUNCH": one_launch, "WIDE_DOT": False}
        sig = {**pointers, **strides, **{name: "constexpr" for name in const}}
        compiled = triton.compile(ASTSource(kernel, sig, const), target=target,
                                  options={"num_warps": 4, "num_stages": 2})
        assert compiled.asm["cubin"], one_launch
    const = {"GROUP": 4, "HEADS": 16, "HEAD_DIM": 128, "SPLITS": 16}
    sig = {**pointers, **strides, **{name: "constexpr" for name in const}}
    assert triton.compile(ASTSource(combine, sig, const), target=target,
                          options={"num_warps": 4}).asm["cubin"]
