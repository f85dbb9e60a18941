"""FP8 weight copies (``fp8.py``, issue #23) on the CPU: the per-row quantisation and why the
copies cannot run here. The Marlin GEMM itself runs in ``tests/test_sensenova_fp8_gpu.py``."""

import torch

from vllm_omni_graphdecode import fp8


def test_fp8_is_unavailable_on_a_cpu_with_the_reason():
    why = fp8.available("cpu")
    assert why is not None and why.same(fp8.NO_FP8) and why.detail == "device is cpu"


def test_quantize_rows_keeps_each_row_within_e4m3_rounding_of_its_own_scale():
    torch.manual_seed(0)
    w = torch.randn(300, 96, dtype=torch.bfloat16) * torch.logspace(-3, 1, 300)[:, None]
    w = w.to(torch.bfloat16)
    w[7] = 0  # a row of zeros
    w8, scale = fp8.quantize_rows(w, chunk=128)  # three chunks, the last one short
    assert w8.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    amax = w.float().abs().amax(dim=1)
    nonzero = amax > 0
    torch.testing.assert_close(scale[nonzero], amax[nonzero] / fp8.FP8_MAX)
    assert scale[7] == 1 and not w8[7].float().any()
    # Each row's largest element lands on +-448 (e4m3's largest), so the row uses e4m3's range.
    top = w8.float().abs().amax(dim=1)
    assert torch.all(top[nonzero] == fp8.FP8_MAX)
    back = fp8.dequantize(w8, scale)
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
    assert torch.equal(fp8.linear(x, w, bias), torch.nn.functional.linear(x, w, bias))
    w8, scale = fp8.w8a8_weight(w)
    got = fp8.linear(x, (w8, scale), bias)
    assert got.shape == (2, 5, 48) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got, fp8.w8a8_reference(x, w8, scale, bias), rtol=1e-2, atol=1e-2)
    without = fp8.linear(x, (w8, scale))
    torch.testing.assert_close(got.float() - without.float(), bias.float().expand_as(got),
                               rtol=0, atol=0.07)  # bf16 rounding of outputs up to ~8


def test_w8a8_copies_are_made_once_refreshed_in_place_and_made_again_after_release():
    torch.manual_seed(2)
    weight = torch.nn.Parameter((torch.randn(32, 64) * 0.05).to(torch.bfloat16), requires_grad=False)
    copies = fp8.W8A8Copies()
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
    want = fp8.w8a8_weight(weight)
    assert torch.equal(again[0].float(), want[0].float()) and torch.equal(again[1], want[1])
    # A write through .data leaves no trace on the parameter: only a release (sleep) sees it.
    weight.data.mul_(0.5)
    assert copies(weight)[0] is w8 and torch.equal(copies(weight)[1], want[1])
    copies.release()
    assert len(copies) == 0 and copies.nbytes == 0
    fresh = copies(weight)
    assert fresh[0] is not w8 and torch.equal(fresh[1], fp8.w8a8_weight(weight)[1])


def test_w8a8_copy_goes_with_its_weight():
    copies = fp8.W8A8Copies()
    weight = torch.nn.Parameter(torch.ones(16, 32, dtype=torch.bfloat16), requires_grad=False)
    copies(weight)
    assert len(copies) == 1
    del weight  # a layer's weight replaced: its copy is freed with it, not kept for ever
    assert len(copies) == 0
