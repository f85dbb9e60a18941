"""The fused decode step's one-launch q/k norm + rope and K/V write (``rope_store.py``) on CPU.

Triton's interpreter runs the kernel's own source on CPU tensors. In fp32 nothing rounds between
the kernel and the model's formula but the fp32 sums, so the kernel must equal
``ops.qk_norm_rope`` (and vllm-omni's own Triton kernel, when it is installed) to the last bit of
every value it writes; in bf16 the interpreter truncates where the GPU rounds, so there it must
stay within a few bf16 units. Bit equality in bf16 with vllm-omni's kernel followed by vLLM's
writer is checked on the GPU (``tests/test_sensenova_gpu.py``).
"""

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

INTERPRETED = r"""
import importlib
import torch
from vllm_omni_graphdecode.hooks.sensenova_u1 import ops, rope_store

try:
    upstream = importlib.import_module(
        "vllm_omni.diffusion.models.sensenova_u1.fused_rmsnorm_rope").triton_qk_norm_rope
except ImportError:
    upstream = None


def case(dtype, heads, kv_heads, d, rows, slots, seed):
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(1, rows, (heads + 2 * kv_heads) * d, generator=g) * 2).to(dtype)
    weights = [(1 + 0.2 * torch.randn(d // 2, generator=g)).to(dtype) for _ in range(4)]
    angles = [torch.randn(1, rows, n, generator=g) * 3 for n in (d // 2, d // 4, d // 4)]
    tables = tuple((a.cos().to(dtype), a.sin().to(dtype)) for a in angles)
    k_cache = torch.zeros(8, 16, kv_heads, d, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    slot = torch.tensor(slots)
    query = rope_store.qk_norm_rope_store(qkv, heads, kv_heads, d, weights, tables, 1e-6,
                                          k_cache, v_cache, slot)
    q, k, v = qkv.view(1, rows, -1, d).split([heads, kv_heads, kv_heads], dim=2)
    want_q, want_k = ops.qk_norm_rope(q, k, *weights, tables, 1e-6, cast_chain=True)
    flat_k, flat_v = k_cache.view(-1, kv_heads, d), v_cache.view(-1, kv_heads, d)
    assert query.shape == (rows, heads, d) and query.dtype == dtype
    # Every other slot stays untouched; V is a copy, bit for bit, in any dtype.
    others = torch.ones(flat_k.shape[0], dtype=torch.bool)
    others[slot] = False
    assert not flat_k[others].any() and not flat_v[others].any()
    assert torch.equal(flat_v[slot], v[0])
    return query, flat_k[slot], want_q[0], want_k[0], (q, k, weights, tables)


# fp32: the model's formula up to the order of the fp32 sums of squares (a few fp32 units),
# vllm-omni's kernel bit for bit. Rows at block edges (15, 16) and far apart.
for heads, kv_heads, d, rows, slots in [(4, 2, 64, 3, [5, 16, 127]), (2, 1, 128, 1, [15]),
                                        (4, 4, 32, 2, [0, 64])]:
    query, key, want_q, want_k, inputs = case(torch.float32, heads, kv_heads, d, rows, slots, d)
    for got, want in ((query, want_q), (key, want_k)):
        err = float(((got - want).abs() / want.abs().clamp_min(1.0)).max())
        assert err <= 2.0 ** -19, (heads, d, err)
    if upstream is not None:
        q, k, weights, tables = inputs
        (ct, st), (ch, sh), (cw, sw) = tables
        up_q, up_k = upstream(q, k, *weights, ct, st, ch, sh, cw, sw, 1e-6)
        assert torch.equal(query, up_q[0].transpose(0, 1))
        assert torch.equal(key, up_k[0].transpose(0, 1))

# bf16: within 4 bf16 units of each value's size (the interpreter truncates at the three
# roundings where the GPU rounds to nearest; the formula rounds its rope products in bf16).
query, key, want_q, want_k, _ = case(torch.bfloat16, 4, 2, 128, 3, [1, 17, 100], 7)
for got, want in ((query, want_q), (key, want_k)):
    err = ((got.float() - want.float()).abs() / want.float().abs().clamp_min(1.0)).max()
    assert float(err) <= 4 * 2.0 ** -7, float(err)

# Rows do not mix: one row alone gives the same bits as that row among three.
g = torch.Generator().manual_seed(3)
qkv = torch.randn(1, 3, 8 * 64, generator=g)
w = [1 + 0.1 * torch.randn(32, generator=g) for _ in range(4)]
angles = [torch.randn(1, 3, n, generator=g) for n in (32, 16, 16)]
tables = tuple((a.cos(), a.sin()) for a in angles)
kc = torch.zeros(4, 16, 2, 64)
vc = torch.zeros_like(kc)
three = rope_store.qk_norm_rope_store(qkv, 4, 2, 64, w, tables, 1e-6, kc, vc,
                                      torch.tensor([2, 3, 4]))
one_tables = tuple((c[:, 1:2], s[:, 1:2]) for c, s in tables)
kc1 = torch.zeros_like(kc)
one = rope_store.qk_norm_rope_store(qkv[:, 1:2], 4, 2, 64, w, one_tables, 1e-6, kc1,
                                    torch.zeros_like(kc), torch.tensor([3]))
assert torch.equal(one[0], three[1])
assert torch.equal(kc1.view(-1, 2, 64)[3], kc.view(-1, 2, 64)[3])
print("ok" if upstream is not None else "ok (vllm-omni's kernel not installed)")
"""


def test_rope_store_equals_the_models_formula_and_writes_only_its_slots_under_triton_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", INTERPRETED], capture_output=True, text=True,
                          env=env, timeout=600, cwd=ROOT, check=False)
    # vllm's import logs on stdout too: the script's verdict is its last line.
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("ok"), proc.stdout[-2000:]


def test_rope_store_says_why_not_off_cuda_and_for_shapes_outside_its_contract():
    from vllm_omni_graphdecode.hooks.sensenova_u1 import rope_store

    why = rope_store.why_not(128, torch.bfloat16, torch.bfloat16, "cpu")
    assert why is not None and why.key == rope_store.NO_ROPE_STORE.key and "cpu" in why.describe()
    if torch.cuda.is_available():
        assert "head_dim 96" in rope_store.why_not(96, torch.bfloat16, torch.bfloat16,
                                                   "cuda").describe()
        assert "cache torch.float8" in rope_store.why_not(
            128, torch.bfloat16, torch.float8_e4m3fn, "cuda").describe()


def test_rope_store_refuses_tables_that_do_not_match_the_rows():
    from vllm_omni_graphdecode.hooks.sensenova_u1 import rope_store

    cos = torch.zeros(1, 2, 64)
    with pytest.raises(ValueError, match="for 3 rows"):
        rope_store._row_stride(cos, cos.clone(), 3)
    with pytest.raises(ValueError, match="unit stride"):
        rope_store._row_stride(cos.transpose(1, 2), cos.transpose(1, 2), 64)
    assert rope_store._row_stride(cos, cos.clone(), 2) == 64


STEP_INTERPRETED = r"""
import torch
from vllm_omni_graphdecode.ops import attention as kernels
from vllm_omni_graphdecode.hooks import sensenova_u1 as hook
from vllm_omni_graphdecode.hooks.sensenova_u1 import rope_store
from vllm_omni_graphdecode.testing import sensenova as st
from vllm_omni_graphdecode.testing.fused_reference import reference_fusion

tok = st.build_tokenizer()
lm = st.build_lm(banned_ids=st.stop_ids(tok))
layout = hook.detect_layout(lm)
pipe = st.build_pipeline(lm, tok)
out, cache_store, t_idx = st.prefill(pipe, st.prompt_ids(tok, 20))
_, cache_plain, _ = st.prefill(pipe, st.prompt_ids(tok, 20))
store = reference_fusion(lm)
store.rope_store = rope_store.qk_norm_rope_store
store.tables_from_forward = not layout.rope_per_layer
plain = reference_fusion(lm)
decoders = [hook.paged_decoder(lm, kernel=kernels.REFERENCE, buckets=(32, 64), graphs=False,
                               fusion=f, kv_writer=None) for f in (store, plain)]
assert "q/k rope + K/V write in one launch" in store.describe()
for dec, cache in zip(decoders, (cache_store, cache_plain)):
    dec.begin(cache)
token = out.logits[:, -1].argmax(-1)
worst = 0.0
with torch.inference_mode():
    for step in range(16):  # 20 + 16 tokens: across the 32 bucket
        a = decoders[0].step(token, t_idx + 1 + step).clone()
        b = decoders[1].step(token, t_idx + 1 + step)
        worst = max(worst, float((a - b).abs().max()) / float(b.abs().max()))
        token = b[:, -1].argmax(-1)
for dec, cache in zip(decoders, (cache_store, cache_plain)):
    dec.write_back(cache)
    dec.release()
cache_diff = max(max(float((x.keys - y.keys).abs().max()),
                     float((x.values - y.values).abs().max()))
                 for x, y in zip(cache_store.layers, cache_plain.layers))
lengths = {x.keys.shape[2] for c in (cache_store, cache_plain) for x in c.layers}
# fp32: the two steps differ in the order of the q/k norms' fp32 sums only.
assert worst < 1e-5 and cache_diff < 1e-5 and lengths == {36}, (worst, cache_diff, lengths)
print("ok", layout.name)
"""


def test_step_with_rope_store_equals_the_step_without_it_under_triton_interpreter():
    """The wiring: ``project_rope_store`` -> ``store_target`` -> ``attend_stored`` in the real
    model's layers (this environment's vllm-omni layout), fp32 plain-torch kernels around the
    interpreted kernel, against the same fused step writing K/V after vllm-omni's formula: the
    same logits and the same cache over 16 tokens across a bucket change."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", STEP_INTERPRETED], capture_output=True,
                          text=True, env=env, timeout=600, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("ok"), proc.stdout[-2000:]
