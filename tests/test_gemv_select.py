"""Which linear layers the fused decode step hands to the compiled GEMV (``gemv.py``), on the
real SenseNova-U1 modules (tiny, CPU). The GEMV itself runs on CUDA only (test_sensenova_gpu.py)."""

import pytest
import torch

from vllm_omni_graphdecode.ops import gemv
from vllm_omni_graphdecode.testing import sensenova as st


@pytest.fixture(scope="module")
def lm():
    return st.build_lm()


def test_no_gemv_off_cuda_and_the_reason_says_so():
    found = gemv.select_gemv("cpu")
    assert not isinstance(found, gemv.Gemv)
    assert found.key == gemv.NO_GEMV.key and "cpu" in found.describe()


def test_plain_vllm_linears_are_taken_and_lora_wrappers_are_not(lm):
    layer = lm.model.layers[0]
    plain = [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
             layer.mlp.down_proj]
    assert all(gemv.Gemv.plain(m) for m in plain)
    wrapped = st.build_lm()
    st.add_lora_wrappers(wrapped)
    attn = wrapped.model.layers[0].self_attn  # the wrappers go on o_proj, as the manager's
    assert not gemv.Gemv.plain(attn.o_proj) and gemv.Gemv.plain(attn.qkv_proj)


def test_a_hooked_linear_or_one_returning_its_bias_apart_is_called_as_itself(lm):
    proj = lm.model.layers[1].self_attn.o_proj
    assert proj.bias is not None  # attention_bias, as the pipeline's default
    handle = proj.register_forward_pre_hook(lambda m, a: None)
    try:
        assert not gemv.Gemv.plain(proj)
    finally:
        handle.remove()
    assert gemv.Gemv.plain(proj)
    proj.skip_bias_add = True
    try:
        assert not gemv.Gemv.plain(proj)
    finally:
        proj.skip_bias_add = False
