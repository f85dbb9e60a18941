"""paged_decode.py on its own (no model): bucket schedule, buffers, growth, write-back, runner.

CPU only, with the reference attention as the kernel. Graph capture itself is covered by the GPU
tests in test_sensenova_gpu.py.
"""

import pytest
import torch
from transformers.cache_utils import DynamicCache

from vllm_omni_graphdecode import kernels, paged_decode, stats
from vllm_omni_graphdecode.paged_decode import BLOCK_SIZE, PagedKVCache, bucket_for, tail_step

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


def test_out_of_memory_while_growing_leaves_the_old_buffers_in_place():
    cache = _cache(buckets=(32, 2 ** 40))
    cache.load(_dynamic_cache(20))
    before = [k.data_ptr() for k in cache.k]
    gen = cache.generation
    with pytest.raises(RuntimeError, match="allocate"):
        cache.reserve(33)
    assert [k.data_ptr() for k in cache.k] == before and cache.generation == gen
    assert cache.capacity == 32 and cache.length == 20


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
    with pytest.raises(paged_decode.CaptureError):
        runner.step()
    assert runner.num_graphs == 0 and stats.get("m", "capture") == 0


def test_release_drops_buffers_and_moves_the_generation():
    cache = _cache()
    cache.load(_dynamic_cache(20))
    gen = cache.generation
    cache.release()
    assert cache.k == [] and cache.nbytes == 0 and cache.generation == gen + 1
