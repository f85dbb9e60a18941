"""The bf16 row GEMV step mode (``ops/row_linears.py``, ``..._SENSENOVA_STEP=rowgemv``, issue
#42) on CPU: the kernel's arithmetic under Triton's interpreter, on the real vllm linear layers
of a tiny SenseNova-U1, and where the mode is refused. Its speed, its rounding on the GPU and the
fused step it serves are ``tests/test_sensenova_gpu.py``'s."""

import torch

from test_fp8 import _run_interpreted
from vllm_omni_graphdecode import config
from vllm_omni_graphdecode.hooks.sensenova_u1 import wiring
from vllm_omni_graphdecode.ops import row_linears, rows_gemm

KERNEL_INTERPRETED = """
import torch
from vllm_omni_graphdecode.ops.fp8 import gemv as fp8_gemv

g = torch.Generator().manual_seed(7)
k_in, inter, n_out = 96, 64, 48
gu_w = (torch.randn(2 * inter, k_in, generator=g) * 0.05).bfloat16()
gu_b = torch.randn(2 * inter, generator=g).bfloat16()
cfg = fp8_gemv.KernelConfig(16, 32, 4)
x = torch.randn(3, k_in, generator=g).bfloat16()
ones = torch.ones(2 * inter, dtype=torch.float32)
# No scale is the unit scale, bit for bit.
plain = fp8_gemv.gemv(x, gu_w, None, gu_b, cfg)
assert torch.equal(plain, fp8_gemv.gemv(x, gu_w, ones, gu_b, cfg))
# ``halves`` reads each gate row's up row from the weight's second half: the same bits as the
# re-ordered (paired) weight, without the copy.
pairs = fp8_gemv.pair_rows(2 * inter)
act = fp8_gemv.gemv(x, gu_w, None, gu_b, cfg, swiglu_out=True, halves=True)
assert act.shape == (3, inter)
assert torch.equal(act, fp8_gemv.gemv(x, gu_w[pairs], ones, gu_b[pairs], cfg, swiglu_out=True))
gate, up = plain.float().chunk(2, dim=-1)
assert torch.allclose(act.float(), gate * torch.sigmoid(gate) * up, rtol=2.0 ** -6, atol=1e-3)
# Rows do not mix.
assert torch.equal(fp8_gemv.gemv(x[1:2], gu_w, None, gu_b, cfg, swiglu_out=True, halves=True)[0],
                   act[1])
try:
    fp8_gemv.gemv(x, gu_w, None, None, cfg, halves=True)
except ValueError as exc:
    assert "swiglu_out" in str(exc)
else:
    raise AssertionError("halves without swiglu_out was accepted")
print("ok")
"""


def test_row_gemv_kernel_halves_and_unit_scale_under_triton_interpreter():
    """``halves`` gives the paired copy's bits from the model's own [gate; up] weight, and no
    scale gives the unit scale's bits."""
    _run_interpreted(KERNEL_INTERPRETED)


LAYERS_INTERPRETED = """
import torch
import torch.nn.functional as F
from vllm_omni_graphdecode.core import stats
from vllm_omni_graphdecode.ops import row_linears, rows_gemm
from vllm_omni_graphdecode.ops.fp8 import gemv as fp8_gemv
from vllm_omni_graphdecode.testing import sensenova as st, common

lm = st.build_lm(dtype=torch.bfloat16)
layer = lm.model.layers[0]
attn, mlp = layer.self_attn, layer.mlp
linears = row_linears.RowLinears("sensenova_u1", table={
    tuple(mlp.gate_up_proj.weight.shape): fp8_gemv.KernelConfig(8, 32, 4)})
g = torch.Generator().manual_seed(1)

def bound(want):
    # fp32 sums in another order and one bf16 rounding each: within two bf16 steps of the
    # largest output (the interpreter truncates where the GPU rounds to nearest).
    return 2 * 2.0 ** -7 * float(want.float().abs().max()) + 1e-3

with torch.inference_mode():
    for module in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
        x = torch.randn(1, 1, module.weight.shape[1], generator=g).bfloat16()
        want = module(x)[0]
        got = linears(module, x)
        assert got.shape == want.shape and got.dtype == torch.bfloat16, type(module).__name__
        err = float((got.float() - want.float()).abs().max())
        assert err <= bound(want), (type(module).__name__, err)
    # The MLP in two launches against the module's own three steps.
    x = torch.randn(1, 1, mlp.gate_up_proj.weight.shape[1], generator=g).bfloat16()
    residual = torch.randn(1, 1, mlp.down_proj.weight.shape[0], generator=g).bfloat16()
    gate_up = mlp.gate_up_proj(x)[0]
    half = gate_up.shape[-1] // 2
    act = (F.silu(gate_up[..., :half].float()) * gate_up[..., half:].float()).bfloat16()
    want = residual + mlp.down_proj(act)[0]
    got = linears.swiglu_mlp(mlp.gate_up_proj, mlp.down_proj, x, residual)
    assert got is not None and got.shape == want.shape
    assert float((got.float() - want.float()).abs().max()) <= 2 * bound(want)
    tail = linears.mlp_tail(mlp.down_proj, gate_up, residual)
    assert float((tail.float() - want.float()).abs().max()) <= 2 * bound(want)

    # The head: the logits processor's projection, through the GEMV on the head's own weight.
    assert linears.take_head(lm) is None and linears.has_head
    hidden = torch.randn(1, 1, lm.config.hidden_size, generator=g).bfloat16()
    want = lm.logits_processor(lm.lm_head, hidden)
    got = linears.logits(hidden, lm.lm_head)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert float((got.float() - want.float()).abs().max()) <= bound(want)
    stats.reset()
    assert linears.logits(hidden, torch.nn.Linear(2, 2)) is None  # the head was replaced
    assert any("lm_head kept on cuBLAS" in key for key in stats.snapshot()["degraded"])

    # A LoRA wrapper with an active adapter is called as itself, counted; inactive, its base
    # layer's GEMV runs.
    stats.reset()
    wrappers = st.add_lora_wrappers(lm)
    o = lm.model.layers[0].self_attn.o_proj
    x = torch.randn(1, 1, o.base_layer.weight.shape[1], generator=g).bfloat16()
    assert torch.equal(linears(o, x), linears(o.base_layer, x))
    assert not stats.snapshot()["degraded"]
    common.bind_adapter(wrappers)
    assert torch.equal(linears(o, x), o(x)[0])
    degraded = stats.snapshot()["degraded"]
    assert any("layer kept on cuBLAS" in key for key in degraded), degraded
print("ok")
"""


def test_row_linears_match_the_real_vllm_layers_and_leave_active_lora_alone():
    """``RowLinears`` on a tiny SenseNova-U1's own vllm layers (qkv, o, gate-up, down) under the
    interpreter: each within two bf16 steps of the module's output, the MLP's two launches
    against its three steps, the head against the logits processor (a replaced head left to the
    model, counted), and a LoRA wrapper called as itself while its adapter is active (counted
    as a degraded path)."""
    _run_interpreted(LAYERS_INTERPRETED)


def test_the_default_step_is_rowgemv_on_hopper_and_fused_elsewhere(monkeypatch):
    """``auto`` (the default) resolves by the device's compute capability; a named mode is
    kept on every device."""
    assert config.parse({"VLLM_OMNI_GRAPHDECODE": "1"}).sensenova_step == "auto"
    assert wiring.resolve_step("auto", "cpu") == "fused"
    capability = {"major": 9}
    monkeypatch.setattr(torch.cuda, "get_device_capability",
                        lambda device=None: (capability["major"], 0))
    assert wiring.resolve_step("auto", "cuda") == "rowgemv"
    assert wiring.resolve_step("auto", torch.device("cuda", 0)) == "rowgemv"
    for major in (7, 8, 10, 12):
        capability["major"] = major
        assert wiring.resolve_step("auto", "cuda") == "fused", major
    for named in ("fused", "tuned", "rowgemv", "exact"):
        for major in (8, 9):
            capability["major"] = major
            assert wiring.resolve_step(named, "cuda") == named
            assert wiring.resolve_step(named, "cpu") == named


def test_rowgemv_is_a_step_mode_and_refused_where_it_cannot_serve():
    assert config.parse({"VLLM_OMNI_GRAPHDECODE": "1",
                         "VLLM_OMNI_GRAPHDECODE_SENSENOVA_STEP": "rowgemv"}).sensenova_step \
        == "rowgemv"
    linears, (why,) = wiring.row_gemv_linears("cpu", 1)
    assert linears is None and row_linears.NO_ROW_GEMV.same(why)
    assert "device is cpu" in why.describe()
    # With the batched step (rows above 1) the 16-row GEMM serves instead
    # (``tests/test_rows_gemm.py``).
    linears, why = wiring.row_gemv_linears("cuda", 8)
    assert isinstance(linears, rows_gemm.RowsLinears) and why == []
    assert "rowgemv" in wiring.FUSED_STEPS and "exact" not in wiring.FUSED_STEPS


FOLDS_INTERPRETED = """
import torch
import torch.nn.functional as F
from vllm_omni_graphdecode.ops import row_linears
from vllm_omni_graphdecode.ops.fp8 import gemv as fp8_gemv
from vllm_omni_graphdecode.ops.layer_ops import REFERENCE_LAYER_OPS as ref
from vllm_omni_graphdecode.testing import sensenova as st

lm = st.build_lm(dtype=torch.bfloat16)
layer, nxt = lm.model.layers[0], lm.model.layers[1]
attn, mlp = layer.self_attn, layer.mlp
linears = row_linears.RowLinears("sensenova_u1", table={
    tuple(mlp.gate_up_proj.weight.shape): fp8_gemv.KernelConfig(8, 32, 4)})
g = torch.Generator().manual_seed(5)
ln2, ln1 = layer.post_attention_layernorm, nxt.input_layernorm
for norm in (ln2, ln1):  # weights away from one, so that a norm left out would show
    norm.weight.data = (1 + 0.2 * torch.randn(norm.weight.shape, generator=g)).bfloat16()

def close(got, want):
    # the squares summed in another order, the interpreter truncating where the GPU rounds:
    # within two bf16 steps of the largest value
    return float((got.float() - want.float()).abs().max()) <= (
        2 * 2.0 ** -7 * float(want.float().abs().max()) + 1e-3)

with torch.inference_mode():
    # o_proj: the residual updated in place, the post-attention norm returned (one launch)
    # against the GEMV, then vLLM's fused_add_rms_norm contract.
    x = torch.randn(1, 1, attn.o_proj.weight.shape[1], generator=g).bfloat16()
    residual = torch.randn(1, 1, attn.o_proj.weight.shape[0], generator=g).bfloat16()
    want_res = residual.clone()
    want_x = linears(attn.o_proj, x)
    ref.add_rms_norm_(want_x, want_res, ln2.weight, ln2.variance_epsilon)
    got_res = residual.clone()
    counts = linears._counts_on(x.device)
    got_x = linears.add_norm(attn.o_proj, x, got_res, ln2.weight, ln2.variance_epsilon)
    assert got_x is not None and got_x.shape == want_x.shape
    # The same launch as the GEMV with its residual add: the same bits (the interpreter rounds
    # that add otherwise than torch's, so the contract's sum is within a step of it).
    plain = fp8_gemv.gemv(x, attn.o_proj.weight, None, attn.o_proj.bias,
                          linears._config(attn.o_proj.weight), residual=residual)
    assert torch.equal(got_res, plain) and close(got_res, want_res)
    assert close(got_x, want_x)
    assert int(counts.abs().sum()) == 0  # the count is back at zero
    # down: residual + the MLP, and the next layer's input norm of it (two launches), against
    # the two-launch MLP and the norm apart.
    x = torch.randn(1, 1, mlp.gate_up_proj.weight.shape[1], generator=g).bfloat16()
    want = linears.swiglu_mlp(mlp.gate_up_proj, mlp.down_proj, x, residual)
    out, normed = linears.swiglu_mlp_norm(mlp.gate_up_proj, mlp.down_proj, x, residual,
                                          ln1.weight, ln1.variance_epsilon)
    assert torch.equal(out, want)
    assert close(normed, ref.rms_norm(want, ln1.weight, ln1.variance_epsilon))
    assert int(counts.abs().sum()) == 0
    # Without the folds, or where a layer is not plain, they answer None (the caller's steps).
    off = row_linears.RowLinears("sensenova_u1", fold_norms=False)
    assert off.add_norm(attn.o_proj, x[..., :attn.o_proj.weight.shape[1]], residual.clone(),
                        ln2.weight, ln2.variance_epsilon) is None
    assert linears.add_norm(torch.nn.Linear(2, 2), x, residual.clone(), ln2.weight,
                            ln2.variance_epsilon) is None
    assert "RMSNorms in the o_proj and down launches" in linears.describe()
    assert "RMSNorms" not in off.describe()
print("ok")
"""


def test_row_gemv_folds_the_norms_after_o_proj_and_down_under_triton_interpreter():
    """``add_norm``: the o_proj GEMV adds into the residual in place and its last program returns
    the post-attention norm; ``swiglu_mlp_norm``: the MLP's two launches, the down launch's last
    program returning the next layer's input norm. The sums equal the unfolded launches bit for
    bit, the norms vLLM's contract within bf16 rounding, the counts back at zero."""
    _run_interpreted(FOLDS_INTERPRETED)


def test_row_gemv_dependent_launch_modes_are_checked_and_need_a_compiled_hopper_launch():
    """``gemv``'s ``pdl`` (issue #42's experiment): an unknown mode names the accepted ones; a
    known one off a compiled launch on compute capability 9.0+ (here: CPU tensors) is refused,
    naming the device, before anything launches."""
    import pytest

    from vllm_omni_graphdecode.ops.fp8 import gemv as fp8_gemv

    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    w = torch.zeros(32, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"pdl='early': accepted: None, 'prefetch', 'wait'"):
        fp8_gemv.gemv(x, w, None, pdl="early")
    for mode in ("prefetch", "wait"):
        with pytest.raises(ValueError,
                           match=r"compute capability 9\.0 or newer \(the input is on cpu\)"):
            fp8_gemv.gemv(x, w, None, pdl=mode)


def test_row_gemv_dependent_launches_are_the_default_on_hopper_only(monkeypatch):
    """``dependent_launches``, what the hook gives the step's ``RowLinears``: "prefetch" on a
    CUDA device of compute capability 9.0+ with compiled Triton, None (plain launches) on an
    older GPU, under Triton's interpreter or off CUDA."""
    import pytest

    pytest.importorskip("triton")
    from vllm_omni_graphdecode.ops.fp8 import gemv as fp8_gemv

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert fp8_gemv.dependent_launches("cpu") is None
    capability = {"cc": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability["cc"])
    assert fp8_gemv.dependent_launches("cuda:0") == "prefetch"
    capability["cc"] = (8, 9)
    assert fp8_gemv.dependent_launches("cuda:0") is None
    capability["cc"] = (10, 0)
    assert fp8_gemv.dependent_launches("cuda:0") == "prefetch"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert fp8_gemv.dependent_launches("cuda:0") is None


PDL_COMPILED = """
import os
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from vllm_omni_graphdecode.ops.fp8 import gemv as fp8_gemv

kernel = fp8_gemv._define(triton, tl)  # a compiled-mode JIT function: no interpreter here
types = {"norm_eps": "fp32", "w_addr": "i64", "count_ptr": "*i32"}
ints = ("N", "K", "stride_xm", "stride_wn", "stride_rm", "stride_om")
# The steps' kinds of launch: qkv's and lm_head's (plain), o_proj's and down's (a residual and
# the norm fold), gate-up's (its gate and up rows read from the bf16 weight's halves, or from
# the FP8 copy's paired rows), each plain and in both modes, on bf16 weights (the row GEMV step)
# and FP8 copies with their scales (the FP8 step).
compiled = 0
for weights in ("bf16", "fp8"):
    fp8 = weights == "fp8"
    w_types = {"w_ptr": "*fp8e4nv", "scale_ptr": "*fp32"} if fp8 else {}
    for kind in ("plain", "fold", "gate_up"):
        gate_up, fold = kind == "gate_up", kind == "fold"
        for mode in (None, "prefetch", "wait"):
            consts = {"HAS_BIAS": False, "SILU_MUL": False, "HAS_RESIDUAL": fold,
                      "EVEN_N": True, "EVEN_K": True, "BLOCK_N": 16, "BLOCK_K": 512,
                      "SWIGLU_OUT": gate_up, "HAS_SCALE": fp8, "HALVES": gate_up and not fp8,
                      "NORM": fold, "NORM_N": 4096, "PDL": mode is not None,
                      "PDL_PREFETCH": mode == "prefetch", "LANES": 256}
            sig = {n: "constexpr" if n in consts else {**types, **w_types}.get(
                n, "i32" if n in ints else "*bf16") for n in kernel.arg_names}
            src = triton.compiler.ASTSource(
                fn=kernel, signature=sig,
                constexprs={(kernel.arg_names.index(n),): v for n, v in consts.items()})
            ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                 options={"num_warps": 8}).asm["ptx"]
            on = mode is not None
            assert ("griddepcontrol.wait" in ptx) is on, (weights, kind, mode)
            assert ("griddepcontrol.launch_dependents" in ptx) is on, (weights, kind, mode)
            assert ("cp.async.bulk.prefetch.L2" in ptx) is (mode == "prefetch"), (weights, kind,
                                                                                  mode)
            compiled += 1
assert compiled == 18, compiled
print("ok")
"""


def test_row_gemv_dependent_launch_compiles_for_hopper_with_its_wait_trigger_and_prefetch():
    """The kernel compiled for sm_90 (Triton's own compiler and ptxas, no GPU needed): with
    ``pdl`` it waits for the kernel before it (``griddepcontrol.wait``) and lets the next one
    start (``griddepcontrol.launch_dependents``), "prefetch" adds the L2 bulk prefetch of each
    row's first block, "wait" does not, and a plain launch has none of them; for qkv's and
    lm_head's launch (plain), o_proj's and down's (residual and norm fold) and gate-up's (gate
    and up rows from the weight's halves, or the FP8 copy's paired rows), on bf16 weights and
    on FP8 copies with their scales."""
    import os
    import subprocess
    import sys

    import pytest

    triton = pytest.importorskip("triton")
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip(f"this Triton has no CUDA compiler to build sm_90 code ({ptxas})")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(CUDA_VISIBLE_DEVICES="", PYTHONPATH=root + os.pathsep + env.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", PDL_COMPILED], capture_output=True, text=True,
                          env=env, timeout=600, cwd=root, check=False)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines and lines[-1] == "ok", proc.stderr[-3000:]
