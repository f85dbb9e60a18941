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
