"""SenseNova-U1's wiring as a maintainer reads it (issue #21), on CPU, on vllm-omni's real code:
``unwire`` puts every patched attribute back and the model answers as before it was wired; a
request walks the language model once (not once per check); a request finds out, in constant
time, when sleep can no longer reach the plugin's release, and runs eagerly with the reason."""

from types import SimpleNamespace

import pytest
import torch

from vllm_omni_graphdecode import config
from vllm_omni_graphdecode.core import eligibility, patching, stats
from vllm_omni_graphdecode.decode.batch import kv as batch_kv
from vllm_omni_graphdecode.hooks import sensenova_u1 as hook
from vllm_omni_graphdecode.hooks.sensenova_u1 import layouts
from vllm_omni_graphdecode.ops import attention as kernels
from vllm_omni_graphdecode.testing import sensenova as st

from test_sensenova_cpu import tiny  # noqa: F401 - the tiny model fixture

MODEL = hook.MODEL
STEPS = 40


def _cfg(**env):
    values = {"VLLM_OMNI_GRAPHDECODE": "sensenova_u1",
              "VLLM_OMNI_GRAPHDECODE_BUCKETS": "32,64",
              "VLLM_OMNI_GRAPHDECODE_PRECAPTURE_BUCKETS": "32",
              "VLLM_OMNI_GRAPHDECODE_SENSENOVA_INTREE": "takeover",
              "VLLM_OMNI_GRAPHDECODE_SENSENOVA_DENOISE": "off"}
    values.update(env)
    return config.parse(values)


def _own_attributes(pipe):
    """Every instance attribute the wiring could touch: the pipeline's, each attention layer's
    and each decoder layer's (identity of the objects held)."""
    lm = pipe.language_model
    return ({k: id(v) for k, v in vars(pipe).items() if not k.startswith("_modules")},
            [dict(vars(a)).get("forward_und") for a in layouts.attention_modules(lm)],
            [dict(vars(layer)).get("_forward_und") for layer in lm.model.layers])


@pytest.mark.parametrize("rows", [1, 4], ids=["one_sequence", "batched"])
def test_unwire_puts_back_every_attribute_and_the_models_own_answers(tiny, rows):
    pipe = st.build_pipeline(tiny.lm, tiny.tok)
    before_attrs = _own_attributes(pipe)
    before = st.run_think(pipe, tiny.ids, STEPS)
    runner = SimpleNamespace(graph_runners={"theirs": 1})
    hook.install(pipe, _cfg(), runner, kernel=kernels.REFERENCE, graphs=False, rows=rows,
                 batch_attention=batch_kv.REFERENCE)
    assert _own_attributes(pipe) != before_attrs
    assert isinstance(runner.graph_runners, patching.ReleaseOnSleep)
    assert hook.unwire(pipe) == []
    assert _own_attributes(pipe) == before_attrs
    assert runner.graph_runners == {"theirs": 1} and type(runner.graph_runners) is dict
    assert hook.unwire(pipe) is None  # nothing wired any more
    after = st.run_think(pipe, tiny.ids, STEPS)
    assert after[1:] == before[1:]
    for a, b in zip(after[0].layers, before[0].layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_unwire_leaves_a_wrapper_stacked_above_and_names_it(tiny):
    pipe = st.build_pipeline(tiny.lm, tiny.tok)
    hook.install(pipe, _cfg(), None, kernel=kernels.REFERENCE, graphs=False)
    ours = pipe._ar_step

    def theirs(*args, **kwargs):
        return ours(*args, **kwargs)

    pipe._ar_step = theirs
    left = hook.unwire(pipe)
    assert any(name.endswith("._ar_step") for name in left)
    assert pipe._ar_step is theirs


def test_a_request_walks_the_language_model_once(tiny, monkeypatch):
    walks = []
    real = eligibility.scan

    def counting(root, label=None):
        walks.append(type(root).__name__)
        return real(root, label)

    monkeypatch.setattr(eligibility, "scan", counting)
    pipe = st.build_pipeline(tiny.lm, tiny.tok)
    hook.install(pipe, _cfg(VLLM_OMNI_GRAPHDECODE_PRECAPTURE="0"), None,
                 kernel=kernels.REFERENCE, graphs=False)
    walks.clear()
    st.run_think(pipe, tiny.ids, STEPS)
    assert len(walks) == 1, walks
    assert stats.get(MODEL, "paged_request") == 1


def test_a_request_runs_eagerly_once_sleep_cannot_reach_the_release(tiny):
    """0.24-0.28: sleep's one call is ``graph_runners.clear()``. Replaced after load, it would not
    drop the plugin's graphs: the next request drops them itself and decodes eagerly."""
    runner = SimpleNamespace(graph_runners={})
    pipe = st.build_pipeline(tiny.lm, tiny.tok)
    hook.install(pipe, _cfg(), runner, kernel=kernels.REFERENCE, graphs=False)
    want = st.run_think(pipe, tiny.ids, STEPS)
    assert getattr(pipe, hook.STATE_ATTR).decoder is not None
    runner.graph_runners = {}  # someone replaced it
    got = st.run_think(pipe, tiny.ids, STEPS)
    assert got[1:] == want[1:]
    assert stats.fallbacks(MODEL) == {f"{MODEL}: {patching.SLEEP_UNREACHABLE}": 1}
    assert getattr(pipe, hook.STATE_ATTR).decoder is None


def test_on_030_the_runners_own_release_reaches_the_plugin_once(tiny):
    """vllm-omni 0.30's runner calls the pipeline's ``release_captured_graphs`` itself: nothing is
    registered on the runner, and one sleep releases once."""
    from vllm_omni.diffusion.worker.diffusion_model_runner import DiffusionModelRunner

    if not callable(getattr(DiffusionModelRunner, "release_captured_graphs", None)):
        pytest.skip("this vllm-omni's runner has no release_captured_graphs")
    runner = object.__new__(DiffusionModelRunner)
    pipe = st.build_pipeline(tiny.lm, tiny.tok)
    hook.install(pipe, _cfg(), runner, kernel=kernels.REFERENCE, graphs=False)
    runner.pipeline = pipe
    assert "release_captured_graphs" not in vars(runner)
    st.run_think(pipe, tiny.ids, STEPS)
    wiring = getattr(pipe, hook.STATE_ATTR)
    releases = []
    real = wiring.sessions.release
    wiring.sessions.release = lambda: (releases.append(1), real())
    runner.release_captured_graphs()
    assert len(releases) == 1 and wiring.decoder is None
