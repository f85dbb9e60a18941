"""The batched step's 16-row bf16 GEMM (``ops/rows_gemm.py``, ``..._SENSENOVA_STEP=rowgemv``
with ``--max-num-seqs`` above 1, issue #42) on CPU: the kernel's arithmetic under Triton's
interpreter (block and split edges, each row as if alone), ``RowsLinears`` on the real vllm
linear layers of a tiny SenseNova-U1, the shape rule, the wiring, and every launch variant
compiled for sm_90 with no GPU. Its speed against cuBLAS is the probe's
(``benchmarks/probes/rows_gemm.py``); the batched step it serves on the GPU is
``tests/test_sensenova_batch_gpu.py``'s."""

from test_fp8 import _run_interpreted
from vllm_omni_graphdecode.hooks.sensenova_u1 import wiring
from vllm_omni_graphdecode.ops import rows_gemm

KERNEL_INTERPRETED = """
import torch
from vllm_omni_graphdecode.ops import rows_gemm as rg

g = torch.Generator().manual_seed(3)
# N and K off the block sizes, K split unevenly, and one split with no K left.
for n, k, cfg in [(96, 80, rg.Config(32, 32, 1)), (70, 100, rg.Config(32, 32, 2)),
                  (64, 256, rg.Config(64, 64, 4)), (40, 48, rg.Config(32, 32, 4))]:
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    x = torch.randn(16, k, generator=g).bfloat16()
    got = rg.rows_gemm(x, w, cfg)
    assert got.shape == (16, n) and got.dtype == torch.bfloat16
    want = x.float() @ w.float().T
    err = (got.float() - want).abs().max().item()
    # fp32 sums in another order, one bf16 rounding
    assert err <= 2 * 2.0 ** -7 * want.abs().max().item() + 1e-3, (n, k, cfg, err)
    for m in (1, 5, 15):  # each row as if alone: the first m rows of the 16-row call
        assert torch.equal(rg.rows_gemm(x[:m], w, cfg), got[:m]), (n, k, cfg, m)
# The bias, added to the fp32 sum before the one rounding, unsplit and split.
for cfg in (rg.Config(32, 32, 1), rg.Config(32, 32, 2)):
    w = (torch.randn(70, 100, generator=g) * 0.05).bfloat16()
    b = torch.randn(70, generator=g).bfloat16()
    x = torch.randn(16, 100, generator=g).bfloat16()
    got = rg.rows_gemm(x, w, cfg, bias=b)
    want = x.float() @ w.float().T + b.float()
    err = (got.float() - want).abs().max().item()
    assert err <= 2 * 2.0 ** -7 * want.abs().max().item() + 1e-3, (cfg, err)
    assert not torch.equal(got, rg.rows_gemm(x, w, cfg))
    assert torch.equal(rg.rows_gemm(x[:3], w, cfg, bias=b), got[:3]), cfg
# The residual: the rounded product plus the residual, as two bf16 tensors add, in the same
# launches (the GEMM's store unsplit, the adding launch split).
for cfg in (rg.Config(32, 32, 1), rg.Config(32, 32, 2)):
    w = (torch.randn(70, 100, generator=g) * 0.05).bfloat16()
    b = torch.randn(70, generator=g).bfloat16()
    x = torch.randn(16, 100, generator=g).bfloat16()
    r = torch.randn(16, 70, generator=g).bfloat16()
    got = rg.rows_gemm(x, w, cfg, bias=b, residual=r)
    want = rg.rows_gemm(x, w, cfg, bias=b) + r
    # one rounding of the sum apart at most (the interpreter truncates where torch rounds)
    err = ((got.float() - want.float()).abs() - 2.0 ** -7 * want.float().abs()).max().item()
    assert err <= 1e-6, (cfg, err)
    assert not torch.equal(got, rg.rows_gemm(x, w, cfg, bias=b)), cfg
    assert torch.equal(rg.rows_gemm(x[:2], w, cfg, bias=b, residual=r[:2]), got[:2]), cfg
# SwiGLU: a [gate; up] weight's rounded halves, silu(gate) rounded, times up, rounded (vLLM's
# silu_and_mul on the rounded projection), unsplit and split, N off the block size.
for n, cfg in ((140, rg.Config(32, 32, 1)), (96, rg.Config(32, 32, 2)),
               (64, rg.Config(64, 64, 4))):
    w = (torch.randn(n, 100, generator=g) * 0.05).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    x = torch.randn(16, 100, generator=g).bfloat16()
    gate, up = rg.rows_gemm(x, w, cfg, bias=b).chunk(2, dim=-1)
    want = (torch.nn.functional.silu(gate.float()).bfloat16().float() * up.float()).bfloat16()
    got = rg.rows_gemm(x, w, cfg, bias=b, swiglu=True)
    assert got.shape == (16, n // 2) and got.dtype == torch.bfloat16, (n, cfg)
    # Two roundings (the SiLU's, the product's), which the interpreter truncates where torch
    # rounds to nearest: at most two bf16 steps of the product apart here.
    err = ((got.float() - want.float()).abs() - 3 * 2.0 ** -7 * want.float().abs()).max().item()
    assert err <= 1e-6, (n, cfg, err)
    assert torch.equal(rg.rows_gemm(x[:5], w, cfg, bias=b, swiglu=True), got[:5]), (n, cfg)
# The last program's adding (``counts``): the same bits as the adding launch, for a split GEMM
# with bias and residual and for SwiGLU split and unsplit, rows off the tile; the counts are
# back at zero after every call. SwiGLU with blocks that do not pair keeps the adding launch.
counts = torch.zeros(64, dtype=torch.int32)
for n, k, cfg, kind in ((70, 100, rg.Config(32, 32, 2), "res"), (64, 256, rg.Config(32, 64, 4),
                        "res"), (128, 100, rg.Config(32, 32, 2), "swiglu"),
                        (128, 100, rg.Config(32, 32, 1), "swiglu"),
                        (96, 100, rg.Config(32, 32, 2), "swiglu")):
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    for m in (16, 5):
        x = torch.randn(m, k, generator=g).bfloat16()
        extra = (dict(residual=torch.randn(m, n, generator=g).bfloat16()) if kind == "res"
                 else dict(swiglu=True))
        want = rg.rows_gemm(x, w, cfg, bias=b, **extra)
        got = rg.rows_gemm(x, w, cfg, bias=b, counts=counts, **extra)
        assert torch.equal(got, want), (n, k, cfg, kind, m)
        assert not counts.any(), (n, cfg, kind, counts)
for bad in (dict(swiglu=True, residual=torch.zeros(16, 16).bfloat16()),
            dict(residual=torch.zeros(16, 8).bfloat16())):
    try:
        rg.rows_gemm(torch.zeros(16, 32).bfloat16(), torch.zeros(32, 32).bfloat16(),
                     rg.Config(32, 32, 1), **bad)
    except ValueError:
        pass
    else:
        raise AssertionError(f"accepted {sorted(bad)}")
try:
    rg.rows_gemm(torch.zeros(17, 32).bfloat16(), torch.zeros(32, 32).bfloat16(),
                 rg.Config(32, 32, 1))
except ValueError as exc:
    assert "17 rows" in str(exc)
else:
    raise AssertionError("17 rows were accepted")
print("ok")
"""


def test_row_gemm_under_the_interpreter_rounds_once_and_keeps_rows_apart():
    _run_interpreted(KERNEL_INTERPRETED)


LAYERS_INTERPRETED = """
import torch
from vllm_omni_graphdecode.core import stats
from vllm_omni_graphdecode.ops import rows_gemm
from vllm_omni_graphdecode.testing import sensenova as st, common

lm = st.build_lm(dtype=torch.bfloat16)
layer = lm.model.layers[0]
attn, mlp = layer.self_attn, layer.mlp
linears = rows_gemm.RowsLinears("sensenova_u1")
g = torch.Generator().manual_seed(1)

def bound(want):
    # fp32 sums in another order and one bf16 rounding each: within two bf16 steps of the
    # largest output (the interpreter truncates where the GPU rounds to nearest).
    return 2 * 2.0 ** -7 * float(want.float().abs().max()) + 1e-3

stats.reset()
with torch.inference_mode():
    for module in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
        # The batched step's shape: its 16 rows as one sequence.
        x = torch.randn(1, 16, module.weight.shape[1], generator=g).bfloat16()
        want = module(x)[0]
        got = linears(module, x)
        assert got.shape == want.shape and got.dtype == torch.bfloat16, type(module).__name__
        err = float((got.float() - want.float()).abs().max())
        assert err <= bound(want), (type(module).__name__, err)
        # A row's output does not depend on the others.
        assert torch.equal(linears(module, x[:, 2:3]), got[:, 2:3]), type(module).__name__
    assert linears.mlp_tail(mlp.down_proj, None, None) is None and not linears.has_head
    # The fused MLP: residual + down(silu(gate) * up), against the modules.
    x = torch.randn(1, 16, mlp.gate_up_proj.weight.shape[1], generator=g).bfloat16()
    residual = torch.randn(1, 16, mlp.down_proj.weight.shape[0], generator=g).bfloat16()
    gate, up = mlp.gate_up_proj(x)[0].chunk(2, dim=-1)
    act = (torch.nn.functional.silu(gate.float()).bfloat16().float() * up.float()).bfloat16()
    want = residual + mlp.down_proj(act)[0]
    got = linears.swiglu_mlp(mlp.gate_up_proj, mlp.down_proj, x, residual)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    err = float((got.float() - want.float()).abs().max())
    assert err <= 2 * bound(want), err
    assert torch.equal(linears.swiglu_mlp(mlp.gate_up_proj, mlp.down_proj, x[:, 4:5],
                                          residual[:, 4:5]), got[:, 4:5])
    assert not stats.snapshot()["degraded"]

    # More rows than the tile holds: the module itself, counted.
    x = torch.randn(1, 17, attn.o_proj.weight.shape[1], generator=g).bfloat16()
    assert torch.equal(linears(attn.o_proj, x), attn.o_proj(x)[0])
    degraded = stats.snapshot()["degraded"]
    assert degraded == {"sensenova_u1: layer kept on cuBLAS": 1}, degraded

    # A LoRA wrapper with an active adapter is called as itself, counted; inactive, its base
    # layer's GEMM runs.
    stats.reset()
    wrappers = st.add_lora_wrappers(lm)
    o = lm.model.layers[0].self_attn.o_proj
    x = torch.randn(1, 16, o.base_layer.weight.shape[1], generator=g).bfloat16()
    assert torch.equal(linears(o, x), linears(o.base_layer, x))
    assert not stats.snapshot()["degraded"]
    common.bind_adapter(wrappers)
    assert torch.equal(linears(o, x), o(x)[0])
    degraded = stats.snapshot()["degraded"]
    assert any("layer kept on cuBLAS" in key for key in degraded), degraded
    # A hooked MLP layer: no fused MLP (the caller runs, and counts, the layers one by one).
    m = lm.model.layers[1].mlp
    stats.reset()
    x = torch.randn(1, 16, m.gate_up_proj.weight.shape[1], generator=g).bfloat16()
    r = torch.randn(1, 16, m.down_proj.weight.shape[0], generator=g).bfloat16()
    assert linears.swiglu_mlp(m.gate_up_proj, m.down_proj, x, r) is not None
    m.down_proj.register_forward_hook(lambda *a: None)
    assert linears.swiglu_mlp(m.gate_up_proj, m.down_proj, x, r) is None
    assert not stats.snapshot()["degraded"]
print("ok")
"""


def test_rows_linears_match_the_real_vllm_layers_and_leave_active_lora_alone():
    """``RowsLinears`` on a tiny SenseNova-U1's own vllm layers under the interpreter: 16 rows
    within two bf16 steps of each module's output, the fused MLP against its
    modules, a row alike alone and among 16; more than 16 rows and a LoRA wrapper with an active
    adapter run the module itself, counted (a hooked MLP layer is not fused)."""
    _run_interpreted(LAYERS_INTERPRETED)


def test_block_sizes_come_from_the_shape_and_reproduce_the_h100_sweeps_picks():
    """``benchmarks/results/h100-2026-12-06`` ``c/rows-gemm/rows-gemm.json``'s ``configs`` at the
    released shape: qkv and gate_up unsplit, o_proj in two K splits, down in four."""
    picks = {(6144, 4096): 1, (4096, 4096): 2, (24576, 4096): 1, (4096, 12288): 4}
    for (n, k), split in picks.items():
        assert rows_gemm.config_for(n, k) == rows_gemm.Config(64, 128, split, 4, 4), (n, k)
    assert rows_gemm.config_for(64, 64).split_k == 2  # a tiny layer: one block, split in two


def test_rowgemv_beside_the_batched_step_reads_the_row_gemm_and_is_refused_off_cuda():
    linears, why = wiring.row_gemv_linears("cuda", 16)
    assert isinstance(linears, rows_gemm.RowsLinears) and why == []
    linears, (why,) = wiring.row_gemv_linears("cpu", 4)
    assert linears is None and rows_gemm.NO_ROWS_GEMM.same(why)
    assert "device is cpu" in why.describe()

    class Fusion:
        gemv = rows_gemm.RowsLinears("sensenova_u1")

    assert wiring._batch_linears_of(Fusion) is Fusion.gemv
    Fusion.gemv = None
    assert wiring._batch_linears_of(Fusion) is None


def test_row_gemm_kernels_compile_for_hopper_on_this_cpu():
    """Every launch variant the batched step uses, compiled by Triton down to an sm_90 cubin
    with no GPU (Triton's own ptxas): a kernel the interpreter runs but the compiler refuses
    would otherwise fail only at a GPU's first batched launch. Each GEMM variant also as a
    dependent launch (``pdl``): it then waits for the kernel before it
    (``griddepcontrol.wait``) and lets the next one start (``griddepcontrol.launch_dependents``),
    "prefetch" adds the L2 bulk prefetch of each row's first block, and a plain launch has none
    of them."""
    import pytest

    triton = pytest.importorskip("triton")
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as exc:
        pytest.skip(f"this Triton has no ahead-of-time compile API ({exc})")
    gemm, add = rows_gemm._kernels()
    target = GPUTarget("cuda", 90, 32)
    ints = {name: "i32" for name in ("M", "N", "K", "stride_xm", "stride_wn", "stride_rm",
                                      "stride_om")}
    for partial, res, fixup, swiglu in ((False, False, False, False), (False, True, False, False),
                                        (True, False, False, False), (True, True, True, False),
                                        (True, False, True, True)):
        for mode in (None, "prefetch", "wait"):
            sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "res_ptr": "*bf16",
                   "part_ptr": "*fp32", "out_ptr": "*bf16", "count_ptr": "*i32",
                   "w_addr": "i64", **ints}
            const = {"BLOCK_N": 64, "BLOCK_K": 128, "ROWS": 16, "SPLIT_K": 2 if partial else 1,
                     "BIAS": True, "WIDEN": False, "PARTIAL": partial, "RES": res,
                     "FIXUP": fixup, "SWIGLU": swiglu, "PDL": mode is not None,
                     "PDL_PREFETCH": mode == "prefetch", "LANES": 128}
            sig.update({name: "constexpr" for name in const})
            compiled = triton.compile(ASTSource(gemm, sig, const), target=target,
                                      options={"num_warps": 4, "num_stages": 4})
            what = (partial, res, fixup, swiglu, mode)
            assert compiled.asm["cubin"], what
            ptx = compiled.asm["ptx"]
            assert ("griddepcontrol.wait" in ptx) is (mode is not None), what
            assert ("griddepcontrol.launch_dependents" in ptx) is (mode is not None), what
            assert ("cp.async.bulk.prefetch.L2" in ptx) is (mode == "prefetch"), what
    for swiglu, res, split in ((False, False, 4), (False, True, 4), (True, False, 1)):
        sig = {"part_ptr": "*fp32", "b_ptr": "*bf16", "res_ptr": "*bf16", "out_ptr": "*bf16",
               **{name: ints[name] for name in ("M", "N", "stride_rm", "stride_om")}}
        const = {"ROWS": 16, "SPLIT_K": split, "BIAS": True, "BLOCK": 1024, "SWIGLU": swiglu,
                 "RES": res}
        sig.update({name: "constexpr" for name in const})
        compiled = triton.compile(ASTSource(add, sig, const), target=target,
                                  options={"num_warps": 4})
        assert compiled.asm["cubin"], (swiglu, res, split)


def test_row_gemm_refuses_an_unknown_launch_mode_and_a_dependent_launch_without_a_gpu():
    """``pdl`` is checked before anything runs: an unknown mode names the accepted ones, and a
    dependent launch on CPU says what it needs."""
    import pytest
    import torch

    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    w = torch.zeros(64, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"pdl='later': accepted: None, 'prefetch', 'wait'"):
        rows_gemm.rows_gemm(x, w, rows_gemm.config_for(64, 64), pdl="later")
    with pytest.raises(ValueError, match="compute capability 9.0 or newer"):
        rows_gemm.rows_gemm(x, w, rows_gemm.config_for(64, 64), pdl="wait")


def test_a_weight_is_prefetchable_only_in_whole_16_byte_units():
    """The bulk prefetch reads 16-byte units: a weight whose rows (K = 4,096) start and end on
    them is prefetchable; one whose row length (K = 4,100) or row stride (a column slice), or
    whose address (a view one element in), is off them is not (its launch only waits)."""
    import torch

    w = torch.zeros(8, 4104, dtype=torch.bfloat16)
    assert rows_gemm.prefetchable(w[:, :4096].contiguous())
    assert rows_gemm.prefetchable(w[:, :4096])  # stride 4,104 elements: 8,208 bytes
    assert not rows_gemm.prefetchable(w[:, :4100].contiguous())
    assert not rows_gemm.prefetchable(torch.zeros(8, 4097, dtype=torch.bfloat16)[:, :4096])
    assert not rows_gemm.prefetchable(w.view(-1)[1:1 + 8 * 4096].view(8, 4096))
