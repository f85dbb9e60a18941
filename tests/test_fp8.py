"""FP8 weight copies (``ops/fp8/``, issue #23) on the CPU: the per-row quantisation and why the
copies cannot run here. The Marlin GEMM itself runs in ``tests/test_sensenova_fp8_gpu.py``."""

import torch

from vllm_omni_graphdecode.ops.fp8 import linears as fp8_linears, marlin as fp8_marlin, quant, w8a8


def test_fp8_is_unavailable_on_a_cpu_with_the_reason():
    why = fp8_marlin.available("cpu")
    assert why is not None and why.same(quant.NO_FP8) and why.detail == "device is cpu"


def test_quantize_rows_keeps_each_row_within_e4m3_rounding_of_its_own_scale():
    torch.manual_seed(0)
    w = torch.randn(300, 96, dtype=torch.bfloat16) * torch.logspace(-3, 1, 300)[:, None]
    w = w.to(torch.bfloat16)
    w[7] = 0  # a row of zeros
    w8, scale = quant.quantize_rows(w, chunk=128)  # three chunks, the last one short
    assert w8.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    amax = w.float().abs().amax(dim=1)
    nonzero = amax > 0
    torch.testing.assert_close(scale[nonzero], amax[nonzero] / quant.FP8_MAX)
    assert scale[7] == 1 and not w8[7].float().any()
    # Each row's largest element lands on +-448 (e4m3's largest), so the row uses e4m3's range.
    top = w8.float().abs().amax(dim=1)
    assert torch.all(top[nonzero] == quant.FP8_MAX)
    back = quant.dequantize(w8, scale)
    err = (back - w.float()).abs()
    # e4m3 keeps 3 mantissa bits: a normal value is off by at most 2^-4 of itself; values under
    # the smallest normal (2^-6 of the scale) by at most half the subnormal step (2^-10 of it).
    bound = torch.maximum(w.float().abs() * 2.0 ** -4, scale[:, None] * 2.0 ** -10)
    assert torch.all(err <= bound * 1.0001)


def test_linear_runs_f_linear_for_a_tensor_and_w8a8_with_bias_for_a_copy():
    torch.manual_seed(1)
    x = torch.randn(2, 5, 64, dtype=torch.bfloat16)
    w = (torch.randn(48, 64) * 0.05).to(torch.bfloat16)
    bias = torch.randn(48, dtype=torch.bfloat16)
    assert torch.equal(w8a8.linear(x, w, bias), torch.nn.functional.linear(x, w, bias))
    w8, scale = w8a8.w8a8_weight(w)
    got = w8a8.linear(x, (w8, scale), bias)
    assert got.shape == (2, 5, 48) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got, w8a8.w8a8_reference(x, w8, scale, bias), rtol=1e-2, atol=1e-2)
    without = w8a8.linear(x, (w8, scale))
    torch.testing.assert_close(got.float() - without.float(), bias.float().expand_as(got),
                               rtol=0, atol=0.07)  # bf16 rounding of outputs up to ~8


def test_w8a8_copies_are_made_once_refreshed_in_place_and_made_again_after_release():
    torch.manual_seed(2)
    weight = torch.nn.Parameter((torch.randn(32, 64) * 0.05).to(torch.bfloat16), requires_grad=False)
    copies = w8a8.W8A8Copies()
    w8, scale = copies(weight)
    assert copies(weight)[0] is w8 and len(copies) == 1
    assert copies.nbytes == 32 * 64 + 32 * 4
    # A write through the parameter: the same tensors (a graph captured with them reads the new
    # values), quantised from the new weight.
    addresses = w8.data_ptr(), scale.data_ptr()
    with torch.no_grad():
        weight.mul_(2)
    again = copies(weight)
    assert (again[0].data_ptr(), again[1].data_ptr()) == addresses
    want = w8a8.w8a8_weight(weight)
    assert torch.equal(again[0].float(), want[0].float()) and torch.equal(again[1], want[1])
    # A write through .data leaves no trace on the parameter: only a release (sleep) sees it.
    weight.data.mul_(0.5)
    assert copies(weight)[0] is w8 and torch.equal(copies(weight)[1], want[1])
    copies.release()
    assert len(copies) == 0 and copies.nbytes == 0
    fresh = copies(weight)
    assert fresh[0] is not w8 and torch.equal(fresh[1], w8a8.w8a8_weight(weight)[1])


def test_w8a8_copy_goes_with_its_weight():
    copies = w8a8.W8A8Copies()
    weight = torch.nn.Parameter(torch.ones(16, 32, dtype=torch.bfloat16), requires_grad=False)
    copies(weight)
    assert len(copies) == 1
    del weight  # a layer's weight replaced: its copy is freed with it, not kept for ever
    assert len(copies) == 0


# -- the one-row GEMV (ops/fp8/gemv.py), under Triton's CPU interpreter ---------------------------

GEMV_INTERPRETED = """
import torch
from vllm_omni_graphdecode.ops.fp8 import gemv as fp8_gemv, quant

g = torch.Generator().manual_seed(0)
# (N, K, bias): one even shape, N and K that no block divides, a K shorter than one block step.
for n, k, with_bias in [(64, 1024, True), (72, 200, False), (40, 96, True)]:
    w = (torch.randn(n, k, generator=g) * 0.02).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16() if with_bias else None
    copy = fp8_gemv.Fp8GemvWeight(w, bias)
    x = torch.randn(5, k, generator=g).bfloat16()
    y = copy(x)
    assert y.shape == (5, n) and y.dtype == torch.bfloat16
    want = x.float() @ quant.dequantize(copy.w8, copy.scale).T
    if bias is not None:
        want = want + bias.float()
    # The products of e4m3 and bf16 values are exact in fp32; what is left is the fp32 sum's
    # order and the output's one rounding to bf16, which the interpreter truncates (the GPU
    # rounds to nearest): within one bf16 ulp of the largest output, plus the sum's rounding.
    err = float((y.float() - want).abs().max())
    assert err <= 2.0 ** -7 * float(want.abs().max()) + 1e-5, (n, k, err)
    # A row is computed alone: the same bits in a 1-row and a 5-row call, whatever the others hold.
    other = x.clone()
    other[1:] = torch.randn(4, k, generator=g).bfloat16()
    assert torch.equal(copy(x[:1])[0], y[0]) and torch.equal(copy(other)[0], y[0]), (n, k)
    # Leading dimensions pass through, and ``out`` is written in place.
    out = torch.empty(5, n, dtype=torch.bfloat16)
    assert torch.equal(copy(x.view(1, 5, k)).view(5, n), y)
    assert copy(x, out=out).data_ptr() == out.data_ptr() and torch.equal(out, y)

# The MLP tail: residual + down(silu(gate) * up) in one launch, as the three steps compute it.
n, k = 48, 320
w = (torch.randn(n, k, generator=g) * 0.02).bfloat16()
bias = torch.randn(n, generator=g).bfloat16()
copy = fp8_gemv.Fp8GemvWeight(w, bias)
gate_up = torch.randn(1, 3, 2 * k, generator=g).bfloat16()
residual = torch.randn(1, 3, n, generator=g).bfloat16()
fused = copy.mlp_tail(gate_up, residual)
assert fused.shape == (1, 3, n)
gate, up = gate_up[..., :k].float(), gate_up[..., k:].float()
act = (gate * torch.sigmoid(gate) * up).bfloat16()
three = (residual.float() + copy(act).float()).bfloat16()
want = fp8_gemv.reference(gate_up, copy.w8, copy.scale, bias, silu_mul=True, residual=residual)
# Within one bf16 ulp of the largest output (the interpreter truncates where the GPU rounds).
scale = float(three.float().abs().max())
assert float((fused.float() - three.float()).abs().max()) <= 2.0 ** -7 * scale * 2, "three steps"
assert float((fused.float() - want.float()).abs().max()) <= 2.0 ** -7 * scale * 2, "reference"
assert torch.equal(copy.mlp_tail(gate_up[:, 1:2], residual[:, 1:2]), fused[:, 1:2])

# A SwiGLU gate-up copy pairs each gate row with its up row: a plain call gives the plain
# copy's bits in the model's [gate; up] order, ``swiglu`` gives silu(gate) * up in one launch
# with the bits the down launch's own SiLU (``mlp_tail``) computes, and ``add_to`` then equals
# ``mlp_tail`` of the plain output. N not a multiple of the block: no pairing, plain order.
k_in, inter, n_out = 96, 64, 48
gu_w = (torch.randn(2 * inter, k_in, generator=g) * 0.05).bfloat16()
down_w = (torch.randn(n_out, inter, generator=g) * 0.05).bfloat16()
plain_gu = fp8_gemv.Fp8GemvWeight(gu_w, config=fp8_gemv.KernelConfig(16, 32, 4))
paired_gu = fp8_gemv.Fp8GemvWeight(gu_w, config=fp8_gemv.KernelConfig(16, 32, 4), swiglu=True)
down = fp8_gemv.Fp8GemvWeight(down_w, config=fp8_gemv.KernelConfig(8, 32, 4))
assert paired_gu.pairs is not None and paired_gu.pairs[:4].tolist() == [0, inter, 1, inter + 1]
x = torch.randn(3, k_in, generator=g).bfloat16()
residual = torch.randn(3, n_out, generator=g).bfloat16()
assert torch.equal(paired_gu(x), plain_gu(x))
act = paired_gu.swiglu(x)
assert act.shape == (3, inter)
assert torch.equal(down.add_to(act, residual), down.mlp_tail(plain_gu(x), residual))
gate, up = plain_gu(x).float().chunk(2, dim=-1)
assert torch.allclose(act.float(), gate * torch.sigmoid(gate) * up, rtol=2.0 ** -6, atol=1e-3)
odd = fp8_gemv.Fp8GemvWeight(gu_w[:72], config=fp8_gemv.KernelConfig(16, 32, 4), swiglu=True)
assert odd.pairs is None
with torch.no_grad():  # a refresh keeps the pairing
    gu_w.mul_(0.5)
paired_gu.refresh(gu_w, None)
plain_gu.refresh(gu_w, None)
assert torch.equal(paired_gu(x), plain_gu(x))
assert torch.equal(down.add_to(paired_gu.swiglu(x), residual), down.mlp_tail(plain_gu(x), residual))

# refresh quantises into the same tensors (graphs captured with them keep their addresses).
w = (torch.randn(64, 512, generator=g) * 0.02).bfloat16()
copy = fp8_gemv.Fp8GemvWeight(w)
ptrs = (copy.w8.data_ptr(), copy.scale.data_ptr())
assert not copy.stale(w, None)
with torch.no_grad():
    w.mul_(2.0)
assert copy.stale(w, None)
x = torch.randn(1, 512, generator=g).bfloat16()
before = copy(x)
copy.refresh(w, None)
assert (copy.w8.data_ptr(), copy.scale.data_ptr()) == ptrs and not copy.stale(w, None)
torch.testing.assert_close(copy(x).float(), 2.0 * before.float(), rtol=2.0 ** -7, atol=1e-4)
print("ok")
"""


def test_fp8_gemv_equals_its_dequantised_weight_and_rows_do_not_mix_under_triton_interpreter():
    """The one-row GEMV's arithmetic, run by Triton's interpreter on CPU tensors (the same kernel
    source the GPU compiles; its speed and the GPU's rounding are checked in
    ``tests/test_sensenova_fp8_gpu.py``)."""
    _run_interpreted(GEMV_INTERPRETED)


def _run_interpreted(script: str) -> None:
    """``script`` in a fresh process with ``TRITON_INTERPRET=1`` (set before Triton is
    imported, as the interpreter needs); it prints ``ok`` last when every assertion held."""
    import os
    import subprocess
    import sys

    import pytest

    pytest.importorskip("triton")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True,
                          text=True, env=env, timeout=300, cwd=root, check=False)
    # The last line: vLLM's loggers may print before it.
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines and lines[-1] == "ok", proc.stderr[-3000:]


BF16_WEIGHTS_INTERPRETED = """
import torch
from vllm_omni_graphdecode.ops.fp8 import gemv as fp8_gemv

# The kernel widens each weight to fp32 whatever its dtype: bf16 weights with unit scales are the
# bf16 row GEMV the probe's --bf16-gemv times against cuBLAS (issue #42).
g = torch.Generator().manual_seed(3)
for n, k, cfg in [(64, 1024, fp8_gemv.KernelConfig(8, 256, 4)),
                  (72, 200, fp8_gemv.KernelConfig(16, 128, 4))]:
    w = (torch.randn(n, k, generator=g) * 0.02).bfloat16()
    ones = torch.ones(n, dtype=torch.float32)
    x = torch.randn(4, k, generator=g).bfloat16()
    y = fp8_gemv.gemv(x, w, ones, None, cfg)
    want = (x.float() @ w.float().T).bfloat16()
    assert y.dtype == torch.bfloat16 and y.shape == (4, n)
    # fp32 sums in another order, one bf16 rounding: within one bf16 step of the exact product.
    torch.testing.assert_close(y.float(), want.float(), rtol=2.0 ** -7, atol=1e-3)
    assert torch.equal(fp8_gemv.gemv(x[2:3], w, ones, None, cfg)[0], y[2])
print("ok")
"""


def test_one_row_gemv_reads_bf16_weights_with_unit_scales_under_triton_interpreter():
    """The same kernel on bf16 weights (what the probe's ``--bf16-gemv`` measures): the product
    within one bf16 rounding, rows computed as alone."""
    _run_interpreted(BF16_WEIGHTS_INTERPRETED)


def test_fp8_gemv_block_sizes_come_from_the_shape_alone():
    """SenseNova-U1's shapes take the measured table's block sizes, which divide them evenly;
    another shape takes the rule's, with enough programs to keep every SM streaming."""
    from vllm_omni_graphdecode.hooks.sensenova_u1.gemv_table import MEASURED
    from vllm_omni_graphdecode.ops.fp8 import gemv as fp8_gemv

    shapes = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (24576, 4096),
              "down": (4096, 12288)}
    for name, (n, k) in shapes.items():
        cfg = fp8_gemv.config_for(n, k, MEASURED)
        assert cfg is MEASURED[(n, k)] and cfg == fp8_gemv.config_for(n, k, MEASURED), name
        assert n % cfg.block_n == 0 and k % cfg.block_k == 0, name
    for n, k in ((5120, 5120), (13824, 5120), (4096, 11008)):
        cfg = fp8_gemv.config_for(n, k, MEASURED)
        assert (n, k) not in MEASURED and n % cfg.block_n == 0, (n, k)
        assert n // cfg.block_n >= 4 * 128, (n, k, cfg)  # ~4 programs per SM of an H200's 132
    assert fp8_gemv.config_for(40, 96).block_k == 128


def test_fp8_one_row_linears_keep_marlin_where_the_gemv_cannot_run():
    from vllm_omni_graphdecode.ops.fp8 import gemv as fp8_gemv

    why = fp8_gemv.available("cpu")
    assert why is not None and why.same(fp8_gemv.NO_GEMV) and "cpu" in why.detail
    assert "Marlin" in why.hint  # what runs instead, said in the WARNING line
    linears = fp8_linears.Fp8Linears("sensenova_u1", one_row=True, device="cpu")
    assert linears.gemv is False and linears._make is fp8_marlin.Fp8Weight
    assert linears.why_not_gemv is not None and linears.why_not_gemv.same(fp8_gemv.NO_GEMV)
    batched = fp8_linears.Fp8Linears("sensenova_u1")
    assert batched._make is fp8_marlin.Fp8Weight and batched.why_not_gemv is None
    assert "vLLM Marlin" in batched.describe()


def test_fp8_lm_head_copy_is_made_only_where_the_one_row_gemv_reads_plain_logits():
    """``Fp8Linears.quantize_head`` on a real SenseNova-U1 language model (tiny, bf16, CPU): the
    head's copy is refused, with ``HEAD_KEPT``'s reason, for Marlin's copies and for each
    logits-processor setting the copy would skip (soft cap, scale, logits as input, another
    head dtype); where the one-row GEMV's copies serve it is made from the head's rows (its
    bytes counted, the load line naming it), and ``release`` drops it until the next use."""
    from vllm_omni_graphdecode.ops.fp8 import gemv as fp8_gemv
    from vllm_omni_graphdecode.testing import sensenova as st

    lm = st.build_lm(dtype=torch.bfloat16)
    marlin = fp8_linears.Fp8Linears("sensenova_u1")
    why = marlin.quantize_head(lm)
    assert why is not None and why.same(fp8_linears.HEAD_KEPT) and "Marlin" in why.detail
    assert not marlin.has_head and marlin.logits(torch.zeros(1, 64)) is None

    # The GEMV's layout (what Fp8Linears(one_row=True) picks on a GPU that runs it); its
    # constructor only quantises, which the CPU does.
    linears = fp8_linears.Fp8Linears("sensenova_u1")
    linears.gemv, linears._make = True, fp8_gemv.Fp8GemvWeight
    processor = lm.logits_processor
    for attr, value, said in (("soft_cap", 30.0, "soft-caps at 30.0"),
                              ("scale", 0.5, "scales by 0.5"),
                              ("logits_as_input", True, "takes logits as input"),
                              ("head_dtype", torch.float32, "computes in torch.float32")):
        before = getattr(processor, attr)
        setattr(processor, attr, value)
        try:
            why = linears.quantize_head(lm)
        finally:
            setattr(processor, attr, before)
        assert why is not None and why.same(fp8_linears.HEAD_KEPT) and said in why.detail, \
            (attr, why)
        assert not linears.has_head
    assert linears.quantize_head(lm) is None and linears.has_head
    # vLLM pads the head's rows (96 -> 128 here); the logits keep the first org_vocab_size.
    padded, hidden = lm.lm_head.weight.shape
    vocab = processor.org_vocab_size
    assert vocab < padded
    copy = linears._head_copy
    assert copy.w8.shape == (vocab, hidden) and copy.w8.dtype == quant.FP8_DTYPE
    assert linears.nbytes == copy.nbytes == vocab * hidden + vocab * 4
    assert "linear layers and lm_head" in linears.describe()
    w8, scale = quant.quantize_rows(lm.lm_head.weight.detach()[:vocab])
    assert torch.equal(copy.w8.view(torch.uint8), w8.view(torch.uint8))
    assert torch.equal(copy.scale, scale)
    linears.release()
    assert linears._head_copy is None and linears.has_head  # made again at the next use
    # A head replaced since (or wrapped by an active LoRA adapter): the model's own runs, counted.
    from vllm_omni_graphdecode.core import stats

    stats.reset()
    assert linears.logits(torch.zeros(1, hidden, dtype=torch.bfloat16),
                          torch.nn.Linear(hidden, vocab)) is None
    assert any("lm_head kept in bf16" in k for k in stats.degraded_paths("sensenova_u1"))


FP8_FOLDS_INTERPRETED = """
import torch
from vllm_omni_graphdecode.ops.fp8 import gemv as fp8_gemv, linears as fp8_linears
from vllm_omni_graphdecode.ops.layer_ops import REFERENCE_LAYER_OPS as ref
from vllm_omni_graphdecode.testing import sensenova as st

lm = st.build_lm(dtype=torch.bfloat16)
layer, nxt = lm.model.layers[0], lm.model.layers[1]
attn, mlp = layer.self_attn, layer.mlp
# The one-row GEMV's copies, as Fp8Linears(one_row=True) makes them on a GPU that runs it.
linears = fp8_linears.Fp8Linears("sensenova_u1")
linears.gemv, linears._make, linears.fold_norms = True, fp8_gemv.Fp8GemvWeight, True
assert linears.quantize({"o_proj": attn.o_proj, "gate_up_proj": mlp.gate_up_proj,
                         "down_proj": mlp.down_proj}) == []
g = torch.Generator().manual_seed(5)
ln2, ln1 = layer.post_attention_layernorm, nxt.input_layernorm
for norm in (ln2, ln1):  # weights away from one, so that a norm left out would show
    norm.weight.data = (1 + 0.2 * torch.randn(norm.weight.shape, generator=g)).bfloat16()


def close(got, want):  # the squares summed in another order, the interpreter truncating
    return float((got.float() - want.float()).abs().max()) <= (
        2 * 2.0 ** -7 * float(want.float().abs().max()) + 1e-3)


with torch.inference_mode():
    x = torch.randn(1, 1, attn.o_proj.weight.shape[1], generator=g).bfloat16()
    residual = torch.randn(1, 1, attn.o_proj.weight.shape[0], generator=g).bfloat16()
    plain = linears._copy_for(attn.o_proj).add_to(x, residual)  # the unfolded launch
    got_res = residual.clone()
    got_x = linears.add_norm(attn.o_proj, x, got_res, ln2.weight, ln2.variance_epsilon)
    assert got_x is not None and got_x.shape == residual.shape
    assert torch.equal(got_res, plain.view(residual.shape))  # the sum in place, bit for bit
    assert close(got_x, ref.rms_norm(plain, ln2.weight, ln2.variance_epsilon))
    counts = linears._counts.made[x.device]
    assert int(counts.abs().sum()) == 0  # the count is back at zero
    h = torch.randn(1, 1, mlp.gate_up_proj.weight.shape[1], generator=g).bfloat16()
    want = linears.swiglu_mlp(mlp.gate_up_proj, mlp.down_proj, h, residual)
    out, normed = linears.swiglu_mlp_norm(mlp.gate_up_proj, mlp.down_proj, h, residual,
                                          ln1.weight, ln1.variance_epsilon)
    assert torch.equal(out, want)
    assert close(normed, ref.rms_norm(want, ln1.weight, ln1.variance_epsilon))
    assert int(counts.abs().sum()) == 0
    desc = linears.describe()
    assert "RMSNorms in the o_proj and down launches" in desc and "dependent" not in desc
    # Without the folds, through Marlin's copies, or for a layer without a copy: None (the
    # caller's own steps).
    linears.fold_norms = False
    assert linears.add_norm(attn.o_proj, x, residual.clone(), ln2.weight,
                            ln2.variance_epsilon) is None
    assert linears.swiglu_mlp_norm(mlp.gate_up_proj, mlp.down_proj, h, residual, ln1.weight,
                                   ln1.variance_epsilon) is None
    linears.fold_norms = True
    assert linears.add_norm(layer.self_attn.qkv_proj, x, residual.clone(), ln2.weight,
                            ln2.variance_epsilon) is None
    marlin = fp8_linears.Fp8Linears("sensenova_u1")
    assert not marlin.fold_norms and marlin.pdl is None
    assert marlin.add_norm(attn.o_proj, x, residual.clone(), ln2.weight,
                           ln2.variance_epsilon) is None
    assert marlin.swiglu_mlp_norm(mlp.gate_up_proj, mlp.down_proj, h, residual, ln1.weight,
                                  ln1.variance_epsilon) is None
print("ok")
"""


def test_fp8_one_row_linears_fold_the_norms_after_o_proj_and_down_under_triton_interpreter():
    """The FP8 one-row GEMV's copies fold the norms as the bf16 row GEMV does: ``add_norm`` adds
    o_proj's product into the residual in place (the unfolded launch's bits) and returns the
    post-attention norm; ``swiglu_mlp_norm``'s sum is ``swiglu_mlp``'s bit for bit and its
    norm the next layer's input norm within bf16 rounding; the counts back at zero; without
    the folds, through Marlin or for a layer without a copy, None."""
    _run_interpreted(FP8_FOLDS_INTERPRETED)


def test_w8a8_copies_with_fast_accumulation_carry_the_flag_to_scaled_mm(monkeypatch):
    """``W8A8Copies(fast_accum=True)`` hands out ``(w8, scale, True)``, and ``linear`` passes the
    flag to ``torch._scaled_mm`` as ``use_fast_accum`` (recorded on the real op's call); plain
    copies pass False. The CPU kernel rounds alike either way; the GPU's rounding and speed are
    the probe's (``benchmarks/probes/fp8_accum.py``)."""
    torch.manual_seed(3)
    weight = (torch.randn(16, 32) * 0.05).to(torch.bfloat16)
    x = torch.randn(4, 32).to(torch.bfloat16)
    seen = []
    real = torch._scaled_mm

    def recording(*args, **kwargs):
        seen.append(kwargs.get("use_fast_accum"))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", recording)
    fast = w8a8.W8A8Copies(fast_accum=True)(weight)
    plain = w8a8.W8A8Copies()(weight)
    assert len(fast) == 3 and fast[2] is True and len(plain) == 2
    assert torch.equal(fast[0].view(torch.uint8), plain[0].view(torch.uint8))
    got = w8a8.linear(x, fast)
    want = w8a8.linear(x, plain)
    assert seen == [True, False]
    torch.testing.assert_close(got.float(), w8a8.w8a8_reference(x, *plain).float(), rtol=2e-2,
                               atol=2e-2)
    assert got.shape == want.shape == (4, 16)
