"""paged_decode.py on its own (no model): bucket schedule, buffers, growth, write-back, runner.

On CPU with the reference attention as the kernel; the GPU-marked tests capture a graph of one
attention step with the kernel the plugin selects there.
"""

import gc

import pytest
import torch
from transformers.cache_utils import DynamicCache

from vllm_omni_graphdecode.core import stats
from vllm_omni_graphdecode.decode import paged as paged_decode
from vllm_omni_graphdecode.decode.paged import BLOCK_SIZE, PagedKVCache, bucket_for, tail_step
from vllm_omni_graphdecode.graphs import capture as cuda_graphs
from vllm_omni_graphdecode.ops import attention as kernels

LAYERS, KV_HEADS, DIM = 3, 2, 16


def _cache(buckets=(32, 64), length=1):
    return PagedKVCache(LAYERS, KV_HEADS, DIM, dtype=torch.float32, device="cpu",
                        buckets=buckets, kernel=kernels.REFERENCE, length=length)


def _dynamic_cache(length, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cache = DynamicCache()
    for i in range(LAYERS):
        k = torch.randn(1, KV_HEADS, length, DIM, generator=gen)
        v = torch.randn(1, KV_HEADS, length, DIM, generator=gen)
        cache.update(k, v, i)
    return cache


def test_bucket_schedule_has_a_tail_step_not_doubling():
    buckets = (512, 1024, 2048, 4096, 8192)
    assert tail_step(buckets) == 4096
    assert [bucket_for(n, buckets) for n in (1, 512, 513, 8192)] == [512, 512, 1024, 8192]
    assert bucket_for(8193, buckets) == 12288
    assert bucket_for(9100, buckets) == 12288
    assert bucket_for(12289, buckets) == 16384
    assert tail_step((64,)) == 64 and bucket_for(65, (64,)) == 128


def test_load_then_write_back_round_trips_a_dynamic_cache():
    src = _dynamic_cache(40)
    cache = _cache()
    assert cache.load(src) == 40
    assert cache.bucket == 64 and cache.length == 40 and int(cache.seqused) == 40
    dst = _dynamic_cache(3, seed=9)
    cache.write_back(dst)
    for a, b in zip(src.layers, dst.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert dst.get_seq_length() == 40


def test_growth_keeps_tokens_publishes_a_new_generation_and_bucket_shrinks_without_one():
    src = _dynamic_cache(30)
    cache = _cache()
    cache.load(src)
    gen0, cap0 = cache.generation, cache.capacity
    assert cap0 == 32
    assert cache.reserve(33) is True  # past capacity: new buffers
    assert cache.generation == gen0 + 1 and cache.capacity == 64 and cache.bucket == 64
    assert cache.reserve(100) is True  # past the last bucket: one tail step (64 + 32 + 32)
    assert cache.capacity == 128 and cache.bucket == 128
    out = _dynamic_cache(1)
    cache.write_back(out)
    for a, b in zip(src.layers, out.layers):
        assert torch.equal(a.keys, b.keys)
    gen = cache.generation
    cache.load(_dynamic_cache(10, seed=3))  # a shorter request: smaller bucket, same buffers
    assert cache.bucket == 32 and cache.capacity == 128 and cache.generation == gen


def test_out_of_memory_on_the_last_allocation_of_a_growth_publishes_nothing(monkeypatch):
    """Growth allocates K and V for every layer; the *last* of those allocations fails. Buffers
    published layer by layer, or a new generation or capacity set before all succeeded, would
    show here."""
    cache = _cache()
    cache.load(_dynamic_cache(20))
    k_before, v_before = list(cache.k), list(cache.v)
    state = (cache.capacity, cache.bucket, cache.generation, cache.length, int(cache.seqused))
    real, calls = paged_decode._alloc, []

    def alloc(shape, dtype, device):
        calls.append(shape)
        if len(calls) == 2 * LAYERS:
            raise torch.OutOfMemoryError("injected: the last of the growth's allocations")
        return real(shape, dtype, device)

    monkeypatch.setattr(paged_decode, "_alloc", alloc)
    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        cache.reserve(33)
    assert len(calls) == 2 * LAYERS
    assert all(a is b for a, b in zip(cache.k, k_before)) and len(cache.k) == LAYERS
    assert all(a is b for a, b in zip(cache.v, v_before)) and len(cache.v) == LAYERS
    assert (cache.capacity, cache.bucket, cache.generation, cache.length,
            int(cache.seqused)) == state
    monkeypatch.setattr(paged_decode, "_alloc", real)
    assert cache.reserve(33) and cache.capacity == 64  # nothing half-done blocks a later growth


def test_attend_writes_the_slot_from_device_state_and_matches_dense_attention():
    src = _dynamic_cache(20)
    cache = _cache()
    cache.load(src)
    cache.set_length(21)
    torch.manual_seed(0)
    q = torch.randn(1, 4, 1, DIM)
    k = torch.randn(1, KV_HEADS, 1, DIM)
    v = torch.randn(1, KV_HEADS, 1, DIM)
    out = cache.attend(1, q, k, v, DIM ** -0.5)
    keys = torch.cat([src.layers[1].keys, k], dim=2).repeat_interleave(2, 1)
    values = torch.cat([src.layers[1].values, v], dim=2).repeat_interleave(2, 1)
    ref = torch.nn.functional.scaled_dot_product_attention(q, keys, values, scale=DIM ** -0.5)
    torch.testing.assert_close(out, ref[:, :, 0], atol=1e-5, rtol=1e-5)
    flat = cache.k[1].view(-1, KV_HEADS, DIM)
    assert torch.equal(flat[20], k[0, :, 0])


def test_buckets_must_be_whole_blocks():
    with pytest.raises(ValueError):
        _cache(buckets=(BLOCK_SIZE + 1,))


def test_runner_without_graphs_runs_the_step_eagerly_and_counts_it():
    cache = _cache()
    calls = []
    runner = paged_decode.DecodeGraphRunner(lambda: calls.append(1) or torch.ones(1), cache,
                                            model="m", graphs=False)
    runner.step()
    runner.step()
    assert len(calls) == 2 and stats.get("m", "paged_eager_step") == 2
    assert runner.num_graphs == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="capture succeeds on a GPU")
def test_runner_capture_failure_is_a_capture_error_and_keeps_nothing():
    cache = _cache()
    runner = paged_decode.DecodeGraphRunner(lambda: torch.ones(1), cache, model="m", pool=object())
    with pytest.raises(cuda_graphs.CaptureFailed):
        runner.step()
    assert runner.num_graphs == 0 and stats.get("m", "capture") == 0


def test_the_collector_is_off_while_a_graph_records_and_as_it_was_after():
    """``cuda_graphs._recording``: no cyclic collection inside a capture (a collected graph
    would fail it), the collector's state restored after, also when the capture raises and
    when a caller had it off."""
    assert gc.isenabled()
    with cuda_graphs._recording():
        assert not gc.isenabled()
        with cuda_graphs._recording():  # nested: the outer capture's state is the one kept
            pass
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="capture failed"):
        with cuda_graphs._recording():
            raise RuntimeError("capture failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with cuda_graphs._recording():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_release_drops_buffers_and_moves_the_generation():
    cache = _cache()
    cache.load(_dynamic_cache(20))
    gen = cache.generation
    cache.release()
    assert cache.k == [] and cache.nbytes == 0 and cache.generation == gen + 1


@pytest.mark.gpu
def test_gpu_a_replay_writes_its_own_slot_and_leaves_the_previous_one_intact():
    """One attention step captured; the length advanced between replays: each replay stores the
    new token's K/V in the slot ``seqused`` names (a device value, read at replay), attends over
    every valid key, and leaves the slot written before untouched."""
    device = torch.device("cuda")
    found = kernels.select_kernel(device, 128)
    if not isinstance(found, kernels.Kernel):
        pytest.skip(f"no paged kernel here: {found.describe()}")
    heads, kv_heads, dim = 8, 2, 128
    cache = PagedKVCache(1, kv_heads, dim, dtype=torch.bfloat16, device=device, buckets=(64,),
                         kernel=found, length=64)
    gen = torch.Generator(device=device).manual_seed(0)
    prefix = [torch.randn(1, kv_heads, 20, dim, generator=gen, device=device).bfloat16()
              for _ in range(2)]
    dyn = DynamicCache()
    dyn.update(prefix[0], prefix[1], 0)
    cache.load(dyn)
    q = torch.zeros(1, heads, 1, dim, dtype=torch.bfloat16, device=device)
    k = torch.zeros(1, kv_heads, 1, dim, dtype=torch.bfloat16, device=device)
    v = torch.zeros_like(k)
    scale = dim ** -0.5
    cache.set_length(21)
    captured = cuda_graphs.capture(lambda: cache.attend(0, q, k, v, scale), device)
    flat_k, flat_v = cache.k[0].view(-1, kv_heads, dim), cache.v[0].view(-1, kv_heads, dim)
    written = {}
    for n in (21, 22, 23):
        cache.set_length(n)
        for t in (q, k, v):
            t.copy_(torch.randn(t.shape, generator=gen, device=device))
        written[n - 1] = (k[0, :, 0].clone(), v[0, :, 0].clone())
        captured.graph.replay()
        keys = flat_k[:n].transpose(0, 1)[None].repeat_interleave(heads // kv_heads, 1)
        values = flat_v[:n].transpose(0, 1)[None].repeat_interleave(heads // kv_heads, 1)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.float(), keys.float(), values.float(), scale=scale)[:, :, 0].to(q.dtype)
        torch.testing.assert_close(captured.output, ref, atol=2e-2, rtol=2e-2)
        for slot, (wk, wv) in written.items():  # this step's slot and every earlier one
            assert torch.equal(flat_k[slot], wk) and torch.equal(flat_v[slot], wv), (n, slot)
    assert torch.equal(flat_k[:20], prefix[0][0].transpose(0, 1))  # the prefix too
