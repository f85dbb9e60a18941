"""SenseNova-U1 image denoising through ``prefix_graph`` (issue #13), on CPU, on vllm-omni's real
pipeline built from the tiny checkpoint (``examples/make_tiny_checkpoints.py``: every module
real, random weights, bf16).

On CPU the branch step runs over the entry's static buffers without capture
(``install(..., image_graphs=False)``): the same step body a graph records on a GPU, so equality
with the pipeline's own steps here is equality of what the graph computes; the capture itself is
tested on the GPU (``tests/test_sensenova_denoise_gpu.py``). Without that override a CPU pipeline
runs its own steps with the reason counted, as production does.
"""

import os

import numpy as np
import pytest
import torch

from vllm_omni_graphdecode import config
from vllm_omni_graphdecode.core import patching, stats
from vllm_omni_graphdecode.hooks import sensenova_u1 as hook
from vllm_omni_graphdecode.hooks.sensenova_u1 import denoise, wiring
from vllm_omni_graphdecode.testing import sensenova as rm

MODEL = denoise.MODEL


def _cfg(**env):
    values = {"VLLM_OMNI_GRAPHDECODE": "sensenova_u1",
              "VLLM_OMNI_GRAPHDECODE_SENSENOVA_DENOISE": "graph"}
    values.update(env)
    return config.parse(values)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = rm.write_tiny_checkpoints(tmp_path_factory.mktemp("tiny_ckpts"))
    return os.path.join(out, "sensenova_u1")


# bf16, as served: vllm-omni's edit path casts the reference images to bf16 whatever the model's
# dtype.
DTYPE = torch.bfloat16


def _pipeline(checkpoint, cfg=None, **install):
    pipe = rm.load_sensenova_pipeline(checkpoint, dtype=DTYPE)
    summary = None
    if cfg is not None:
        summary = hook.install(pipe, cfg, install.pop("runner", None), **install)
    return pipe, summary


def _branches(caches):
    """The branch caches in the order each was first seen."""
    seen = []
    for cache in caches:
        if all(cache is not c for c in seen):
            seen.append(cache)
    return seen


CASES = {
    "t2i_cfg4": (rm.image_request(), 0, 2),
    "t2i_cfg1": (rm.image_request(cfg_scale=1.0), 0, 1),
    "t2i_cfg_zero_star": (rm.image_request(cfg_norm="cfg_zero_star", num_steps=2), 0, 2),
    # cfg 4 with image cfg 2: cond, img_cond and uncond branches every step
    "edit_two_refs_three_branches": (rm.image_request(img_cfg_scale=2.0, num_steps=2), 2, 3),
    # image cfg 1: cond and img_cond
    "edit_two_refs_img_cond": (rm.image_request(num_steps=2), 2, 2),
}


@pytest.fixture(scope="module")
def eager(checkpoint):
    """The unwired pipeline's image and branch steps, per case."""
    pipe, _ = _pipeline(checkpoint)
    results = {}
    for name, (request, refs, _) in CASES.items():
        image, outs, caches = rm.generate_image(pipe, request, refs)
        results[name] = (image, outs, len(_branches(caches)))
    return results


@pytest.mark.parametrize("case", list(CASES))
def test_static_branch_steps_equal_the_pipelines_own_steps(checkpoint, eager, case):
    request, refs, branches = CASES[case]
    pipe, summary = _pipeline(checkpoint, _cfg(), image_graphs=False)
    assert "image denoising: each CFG branch's step replayed" in summary
    image, calls, caches = rm.generate_image(pipe, request, refs)
    want_image, want_steps, want_branches = eager[case]
    assert want_branches == branches == len(_branches(caches))
    assert len(calls) == len(want_steps) == request.num_steps * branches
    for i, (got, want) in enumerate(zip(calls, want_steps)):
        assert torch.equal(got, want), f"branch step {i} differs by {(got - want).abs().max()}"
    assert np.array_equal(image, want_image)
    assert stats.get(MODEL, "static_step") == len(calls)
    assert stats.get(MODEL, "eager_branch") == 0 and stats.fallbacks(MODEL) == {}
    # the loop returned: every branch's entry is back in the pool, none lost
    info = pipe._graphdecode_sensenova_u1_image.graphs.info()
    assert info["live"] == 0 and info["entries"] == branches


def test_on_by_default(checkpoint):
    cfg = config.parse({"VLLM_OMNI_GRAPHDECODE": "1"})
    assert cfg.sensenova_denoise == "graph"
    pipe, summary = _pipeline(checkpoint, cfg)
    assert "image denoising: each CFG branch's step replayed" in summary
    assert getattr(pipe, wiring.IMAGE_ATTR, None) is not None


def test_off_leaves_the_denoising_steps_alone(checkpoint, eager):
    pipe, summary = _pipeline(checkpoint, config.parse({
        "VLLM_OMNI_GRAPHDECODE": "1", "VLLM_OMNI_GRAPHDECODE_SENSENOVA_DENOISE": "off"}))
    assert "VLLM_OMNI_GRAPHDECODE_SENSENOVA_DENOISE=off" in summary
    assert "_t2i_predict_v" not in vars(pipe) and "_run_denoising_loop" not in vars(pipe)
    assert getattr(pipe, wiring.IMAGE_ATTR, None) is None


def test_on_cpu_each_branch_runs_the_pipelines_own_step_with_the_reason_counted_once(
        checkpoint, eager, stats_warnings):
    pipe, _ = _pipeline(checkpoint, _cfg())  # production: graphs on CUDA only
    request = CASES["t2i_cfg4"][0]
    for _ in range(2):
        image = rm.generate_image(pipe, request)[0]
    assert np.array_equal(image, eager["t2i_cfg4"][0])
    # counted once per request branch, warned once per process
    assert stats.fallbacks(MODEL) == {f"{MODEL}: {denoise.NOT_CUDA.key}": 4}
    assert stats.get(MODEL, "eager_branch") == 2 * 2 * request.num_steps
    lines = stats_warnings
    assert len(lines) == 1 and denoise.NOT_CUDA.key in lines[0]
    assert denoise.NOT_CUDA.hint in lines[0]


@pytest.mark.parametrize("setting,reason", [
    (("cache_backend", "cache_dit"), denoise.CACHE_BACKEND),
    (("parallel_config.cfg_parallel_size", 2), denoise.PARALLEL),
    (("enable_cpu_offload", True), hook.OFFLOAD),
])
def test_a_pipeline_the_step_cannot_serve_runs_its_own_steps_with_the_reason(
        checkpoint, eager, setting, reason):
    pipe, _ = _pipeline(checkpoint, _cfg(), image_graphs=False)
    name, value = setting
    owner = pipe.od_config
    *path, attr = name.split(".")
    for part in path:
        owner = getattr(owner, part)
    setattr(owner, attr, value)
    image = rm.generate_image(pipe, CASES["t2i_cfg4"][0])[0]
    assert np.array_equal(image, eager["t2i_cfg4"][0])
    assert stats.fallbacks(MODEL) == {f"{MODEL}: {reason.key}": 2}
    assert stats.get(MODEL, "static_step") == 0


def test_lora_wrappers_run_the_pipelines_own_steps(checkpoint):
    pipe, _ = _pipeline(checkpoint, _cfg(), image_graphs=False)
    rm.add_lora_wrappers(pipe.language_model)
    rm.generate_image(pipe, rm.image_request(num_steps=1))
    assert stats.fallbacks(MODEL) == {f"{MODEL}: {denoise.LORA.key}": 2}


def test_two_requests_interleaved_step_by_step_equal_their_serial_runs(checkpoint):
    """Two requests in flight (different prompts, so different prefixes) take turns at every
    branch step: each has its own entries, and each equals its own run alone."""
    requests = [rm.image_request("a red cube on a table", seed=1),
                rm.image_request("two green spheres", seed=2)]
    alone, _ = _pipeline(checkpoint)
    serial = [rm.generate_image(alone, request)[:2] for request in requests]
    pipe, _ = _pipeline(checkpoint, _cfg(), image_graphs=False)
    graphs = getattr(pipe, wiring.IMAGE_ATTR).graphs
    live = []
    results = rm.interleaved(pipe, requests, on_step=lambda: live.append(graphs.info()["live"]))
    assert max(live) == 4  # two requests x two branches, each with an entry of its own
    for (image, outs), (want_image, want_outs) in zip(results, serial):
        assert np.array_equal(image, want_image)
        assert len(outs) == len(want_outs)
        assert all(torch.equal(a, b) for a, b in zip(outs, want_outs))


def test_entries_are_reused_across_requests_and_released_on_sleep(checkpoint, eager):
    pipe, _ = _pipeline(checkpoint, _cfg(), image_graphs=False)
    state = getattr(pipe, wiring.IMAGE_ATTR)
    request = CASES["t2i_cfg4"][0]
    for _ in range(3):
        assert np.array_equal(rm.generate_image(pipe, request)[0], eager["t2i_cfg4"][0])
        assert state.graphs.info() == {"entries": 2, "live": 0, "captured": 0, "eager_keys": 0}
    pipe.release_captured_graphs()  # what vllm-omni's sleep level 2 reaches
    assert state.graphs.info()["entries"] == 0
    assert np.array_equal(rm.generate_image(pipe, request)[0], eager["t2i_cfg4"][0])
    assert stats.get(MODEL, "static_step") == 4 * 2 * request.num_steps


def test_idle_entries_of_past_prompt_lengths_are_dropped_and_the_uncond_entry_stays(checkpoint):
    """Each new prompt length is a new cond key; the pool keeps at most IDLE_ENTRIES idle, least
    recently used dropped first, so the uncond entry (same key every request) stays."""
    pipe, _ = _pipeline(checkpoint, _cfg(), image_graphs=False)
    graphs = getattr(pipe, wiring.IMAGE_ATTR).graphs
    prompts = ["a cube", "a red cube on a table", "two green spheres beside a tall blue vase",
               "a small house under a wide grey sky at dawn with rain"]
    for i, prompt in enumerate(prompts):
        rm.generate_image(pipe, rm.image_request(prompt, num_steps=1))
        assert graphs.info()["entries"] == min(i + 2, denoise.IDLE_ENTRIES)
    lengths = {entry.key.prefix_len for entry in graphs._entries.values()}
    assert len(lengths) == denoise.IDLE_ENTRIES  # uncond's and the last two prompts' cond lengths
    assert stats.get(MODEL, "idle_evictions") == len(prompts) + 1 - denoise.IDLE_ENTRIES
    uncond = min(lengths)
    rm.generate_image(pipe, rm.image_request(prompts[-1], num_steps=1))
    assert {entry.key.prefix_len for entry in graphs._entries.values()} == lengths
    assert min(lengths) == uncond and stats.get(MODEL, "idle_evictions") == 2


def test_a_moved_branch_step_leaves_denoising_unwired_with_the_reason(checkpoint):
    pipe = rm.load_sensenova_pipeline(checkpoint, dtype=DTYPE)

    class Moved(type(pipe)):
        def _t2i_predict_v(self, embeds, indexes, mask, cache, t, z, tokens, **kw):
            return super()._t2i_predict_v(embeds, indexes, mask, cache, t, z, tokens, **kw)

    pipe.__class__ = Moved
    summary = hook.install(pipe, _cfg(), None, image_graphs=False)
    assert "image denoising not wired" in summary and "_t2i_predict_v" in summary
    assert "_t2i_predict_v" not in vars(pipe)
    assert stats.fallbacks(MODEL) == {f"{MODEL}: {patching.SIGNATURE_MOVED.key}": 1}


def test_bad_denoise_value_names_the_variable_and_what_is_accepted():
    with pytest.raises(config.ConfigError) as err:
        _cfg(VLLM_OMNI_GRAPHDECODE_SENSENOVA_DENOISE="compiled")
    assert str(err.value) == ("VLLM_OMNI_GRAPHDECODE_SENSENOVA_DENOISE='compiled' is not "
                              "accepted; accepted: off, graph, fast")


def test_a_branch_binding_after_sleeps_release_was_replaced_runs_the_pipelines_own_step(
        checkpoint, eager):
    """The denoiser registered on a runner checks at each branch's first step that sleep level 2
    still reaches it; once the runner's graph_runners was replaced, branches run the pipeline's
    own steps with the reason (their graphs may sit on memory a sleep discarded)."""
    from types import SimpleNamespace

    from vllm_omni_graphdecode.hooks.sensenova_u1 import layouts

    pipe = rm.load_sensenova_pipeline(checkpoint, dtype=DTYPE)
    runner = SimpleNamespace(pipeline=pipe)  # 0.24-0.28: sleep calls graph_runners.clear()
    layout = layouts.detect_layout(pipe.language_model, type(pipe))
    denoiser = denoise.install(pipe, layout, _cfg(), capture=False, runner=runner)
    patching.release_on_sleep(runner, denoiser.release)
    request = CASES["t2i_cfg4"][0]
    assert np.array_equal(rm.generate_image(pipe, request)[0], eager["t2i_cfg4"][0])
    assert stats.get(MODEL, "static_step") == 2 * request.num_steps
    runner.graph_runners = {}
    assert np.array_equal(rm.generate_image(pipe, request)[0], eager["t2i_cfg4"][0])
    assert stats.get(MODEL, "static_step") == 2 * request.num_steps
    assert stats.fallbacks(MODEL) == {f"{MODEL}: {patching.SLEEP_UNREACHABLE.key}": 2}
    assert denoiser.graphs.info()["entries"] == 0


def _failing_at(pipe, call: int):
    """The plugin's branch step, raising at its ``call``-th call (after the branches bound)."""
    step = pipe._t2i_predict_v
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            raise RuntimeError("injected: a request failing mid-denoise")
        return step(*args, **kwargs)

    return failing, step


def test_a_request_that_fails_mid_denoise_gives_its_entries_back(checkpoint, eager):
    """Its traceback keeps the request's caches (the entries' owners) alive, as an engine's error
    path or a reference cycle may until a collection: the entries are back in the pool anyway,
    and the next request takes them."""
    pipe, _ = _pipeline(checkpoint, _cfg(), image_graphs=False)
    graphs = getattr(pipe, wiring.IMAGE_ATTR).graphs
    request = CASES["t2i_cfg4"][0]
    rm.generate_image(pipe, request)
    entries = list(graphs._entries.values())
    pipe._t2i_predict_v, step = _failing_at(pipe, 3)
    try:
        with pytest.raises(RuntimeError, match="injected") as failed:
            rm.generate_image(pipe, request)
    finally:
        pipe._t2i_predict_v = step
    assert failed.value.__traceback__ is not None  # held: its frames hold the caches
    assert graphs.info()["live"] == 0
    image = rm.generate_image(pipe, request)[0]
    assert np.array_equal(image, eager["t2i_cfg4"][0])
    reused = list(graphs._entries.values())
    assert len(reused) == len(entries)
    assert all(any(e is old for old in entries) for e in reused)  # the same entries, reused


def test_a_tensor_argument_of_the_branch_step_refuses_the_graph_with_its_reason(checkpoint):
    """The step's non-tensor arguments are part of its key and baked into its graph; a tensor
    among them would be read at its capture-time address. vllm-omni passes ``t_eps`` as a float;
    given as a tensor, the branches run the pipeline's own steps, counted."""
    request = rm.image_request(t_eps=torch.tensor(0.02), num_steps=2)
    alone, _ = _pipeline(checkpoint)
    want = rm.generate_image(alone, request)
    pipe, _ = _pipeline(checkpoint, _cfg(), image_graphs=False)
    got = rm.generate_image(pipe, request)
    assert np.array_equal(got[0], want[0])
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
    assert stats.fallbacks(MODEL) == {f"{MODEL}: {denoise.ARGUMENTS.key}": 2}
    assert stats.get(MODEL, "static_step") == 0
    assert getattr(pipe, wiring.IMAGE_ATTR).graphs.info()["entries"] == 0
