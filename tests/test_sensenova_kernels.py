"""kernels.py: the reference paged attention is exact attention, and kernel selection says why not.

CPU only, no vllm-omni import. The reasons that need a GPU to arise naturally (import failure of
the CUDA kernel, a signature without the paged arguments, an unsupported FA version) are produced
by replacing the kernel import with what a broken or old wheel would give.
"""

import inspect

import pytest
import torch

from vllm_omni_graphdecode.ops import attention as kernels


def _paged(k_dense, block_size=16, extra_blocks=2):
    """Dense [L, H, D] keys into (blocks, block_size, H, D) plus an identity table."""
    length, heads, dim = k_dense.shape
    blocks = -(-length // block_size) + extra_blocks
    buf = torch.randn(blocks, block_size, heads, dim)  # garbage past `length` must be ignored
    buf.view(-1, heads, dim)[:length] = k_dense
    return buf, torch.arange(blocks, dtype=torch.int32)[None]


@pytest.mark.parametrize("length", [1, 15, 16, 17, 40])
def test_reference_paged_attention_equals_dense_gqa_attention(length):
    torch.manual_seed(length)
    q_heads, kv_heads, dim = 4, 2, 16
    q = torch.randn(1, q_heads, dim)
    k = torch.randn(length, kv_heads, dim)
    v = torch.randn(length, kv_heads, dim)
    kc, table = _paged(k)
    vc, _ = _paged(v)
    out = kernels.reference_paged_attention(
        q, kc, vc, max_seqlen_q=1, cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32),
        max_seqlen_k=table.shape[1] * 16, seqused_k=torch.tensor([length], dtype=torch.int32),
        block_table=table, softmax_scale=dim ** -0.5)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, None], k.transpose(0, 1)[None].repeat_interleave(2, 1),
        v.transpose(0, 1)[None].repeat_interleave(2, 1), scale=dim ** -0.5)[:, :, 0]
    assert out.shape == (1, q_heads, dim)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_reference_kernel_has_the_flash_call_contract():
    params = inspect.signature(kernels.reference_paged_attention).parameters
    assert all(p in params for p in kernels.PAGED_KWARGS)
    assert kernels.REFERENCE.fa_version is None


def test_select_kernel_not_cuda():
    found = kernels.select_kernel(torch.device("cpu"), 128, "auto")
    assert not isinstance(found, kernels.Kernel)
    assert kernels.NOT_CUDA.same(found) and "cpu" in found.detail and found.hint


@pytest.mark.parametrize("head_dim", [100, 264])
def test_select_kernel_bad_head_dim(head_dim):
    found = kernels.select_kernel("cuda", head_dim, "auto")
    assert kernels.BAD_HEAD_DIM.same(found) and str(head_dim) in found.detail


def test_select_kernel_import_failed(monkeypatch):
    def broken():
        raise ImportError("libcudart.so.13: cannot open shared object file")

    monkeypatch.setattr(kernels, "_import_varlen", broken)
    found = kernels.select_kernel("cuda", 128, "auto")
    assert kernels.IMPORT_FAILED.same(found) and "libcudart" in found.detail


def test_select_kernel_signature_lacks_paged_kwargs(monkeypatch):
    def old_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                   softmax_scale=None, causal=False):
        raise AssertionError("never called")

    monkeypatch.setattr(kernels, "_import_varlen", lambda: old_varlen)
    found = kernels.select_kernel("cuda", 128, "auto")
    assert kernels.NO_PAGED_KWARGS.same(found)
    assert "seqused_k" in found.detail and "block_table" in found.detail


def test_select_kernel_requested_fa_version_unsupported(monkeypatch):
    # A paged varlen without `fa_version` runs FA2 only: asking for 3 must be refused, 2 accepted.
    monkeypatch.setattr(kernels, "_import_varlen", lambda: kernels.reference_paged_attention)
    found = kernels.select_kernel("cuda", 128, "3")
    assert kernels.FA_VERSION_UNSUPPORTED.same(found) and "FA3" in found.detail
    ok = kernels.select_kernel("cuda", 128, "2")
    assert isinstance(ok, kernels.Kernel) and ok.fa_version == 2 and ok.extra == ()


def test_describe_names_the_reason_on_cpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU; describe() names a kernel there")
    line = kernels.describe("auto", head_dim=128)
    assert line.startswith("paged decode kernel: none: not CUDA")
