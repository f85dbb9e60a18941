"""Registration and the model-load hook, against the installed vllm and vllm-omni."""

import importlib
import importlib.metadata
import logging
import sys
import types

import pytest

import vllm_omni_graphdecode
from vllm_omni_graphdecode import config, hooks, models
from vllm_omni_graphdecode.core import loading, stats
from vllm_omni_graphdecode.core.patching import HookRefused
from vllm_omni_graphdecode.core.reasons import Reason

GROUPS = ("vllm.general_plugins", "vllm_omni.general_plugins")


@pytest.fixture
def runner_cls():
    """The real DiffusionModelRunner, with its original load_model restored afterwards."""
    module = importlib.import_module(loading.RUNNER_MODULE)
    cls = module.DiffusionModelRunner
    original = cls.__dict__["load_model"]
    yield cls
    cls.load_model = original
    loading._patched_classes.discard(cls)


@pytest.fixture
def fresh_register(monkeypatch):
    monkeypatch.setattr(vllm_omni_graphdecode, "_registered", False)
    yield
    if loading._finder in sys.meta_path:
        sys.meta_path.remove(loading._finder)


@pytest.mark.parametrize("group", GROUPS)
def test_entry_point_is_discoverable_and_resolves_to_register(group):
    eps = [ep for ep in importlib.metadata.entry_points(group=group)
           if ep.name == "vllm_omni_graphdecode"]
    assert len(eps) == 1, f"not installed under {group}: run scripts/setup_env.sh"
    assert eps[0].load() is vllm_omni_graphdecode.register


def test_register_twice_patches_once(monkeypatch, fresh_register, runner_cls):
    monkeypatch.setenv("VLLM_OMNI_GRAPHDECODE", "1")
    original = runner_cls.load_model
    vllm_omni_graphdecode.register()
    wrapped = runner_cls.load_model
    assert wrapped is not original and wrapped.__graphdecode__
    assert wrapped.__wrapped__ is original
    vllm_omni_graphdecode.register()
    monkeypatch.setattr(vllm_omni_graphdecode, "_registered", False)
    vllm_omni_graphdecode.register()  # even a second full pass does not wrap twice
    assert runner_cls.load_model is wrapped


def test_register_patches_on_import_when_runner_module_not_imported_yet(
        monkeypatch, fresh_register, runner_cls):
    monkeypatch.setenv("VLLM_OMNI_GRAPHDECODE", "1")
    saved = sys.modules.pop(loading.RUNNER_MODULE)
    try:
        vllm_omni_graphdecode.register()
        assert loading._finder in sys.meta_path
        fresh = importlib.import_module(loading.RUNNER_MODULE)
        assert fresh.DiffusionModelRunner.load_model.__graphdecode__
    finally:
        sys.modules[loading.RUNNER_MODULE] = saved


def test_disabled_register_patches_nothing(monkeypatch, fresh_register, runner_cls):
    monkeypatch.delenv("VLLM_OMNI_GRAPHDECODE", raising=False)
    original = runner_cls.load_model
    vllm_omni_graphdecode.register()
    assert runner_cls.load_model is original
    assert loading._finder not in sys.meta_path


def test_register_rejects_invalid_value_at_startup(monkeypatch, fresh_register):
    monkeypatch.setenv("VLLM_OMNI_GRAPHDECODE", "yes-please")
    with pytest.raises(config.ConfigError, match="VLLM_OMNI_GRAPHDECODE='yes-please'"):
        vllm_omni_graphdecode.register()


def _bare_runner(cls, pipeline):
    """A real DiffusionModelRunner instance without its GPU-only constructor."""
    runner = object.__new__(cls)
    runner.pipeline = pipeline
    return runner


def _install_hook(monkeypatch, model, module):
    """Register ``module`` as ``model``'s hook, the one way a real hook is registered."""
    sys.modules[module.__name__] = module
    rows = tuple(models.Model(m.key, m.title, module.__name__) if m.key == model else m
                 for m in models.MODELS)
    monkeypatch.setattr(models, "MODELS", rows)
    monkeypatch.setattr(config, "_CONFIG", config.parse({"VLLM_OMNI_GRAPHDECODE": model}))


def _hook(name, wire):
    mod = types.ModuleType(f"graphdecode_test_hook_{name}")
    mod.MODEL = "sensenova_u1"
    mod.find_target = lambda p: p if getattr(p, "claimed_by", None) == name else None
    mod.wire = wire
    mod.support = lambda: {}
    return mod


@pytest.fixture
def vllm_log():
    """What reaches the "vllm" logger, the one vllm attaches its handlers to (not the root)."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("vllm").addHandler(handler)
    yield records
    logging.getLogger("vllm").removeHandler(handler)


def _vllm_output(records):
    return "\n".join(r.getMessage() for r in records)


class Pipeline:
    claimed_by = "test"


def test_load_wrapper_calls_real_load_then_claiming_hook(monkeypatch, runner_cls, vllm_log):
    calls = []

    def wire(target, cfg, runner):
        calls.append(("wire", target, runner))
        return "wired for the test"

    _install_hook(monkeypatch, "sensenova_u1", _hook("test", wire))
    assert loading.patch_runner_class(runner_cls)
    pipeline = Pipeline()
    runner = _bare_runner(runner_cls, pipeline)
    # load_format="dummy" is the real load_model's own early return: it runs, loads nothing.
    runner.load_model(load_format="dummy")
    assert calls == [("wire", pipeline, runner)]
    assert "graphdecode: sensenova_u1: wired for the test" in _vllm_output(vllm_log)


def test_hook_found_on_diffusers_adapter_inner_pipeline(monkeypatch, runner_cls):
    seen = []
    _install_hook(monkeypatch, "sensenova_u1",
                  _hook("test", lambda t, c, r: seen.append(t) or "ok"))
    loading.patch_runner_class(runner_cls)
    adapter = types.SimpleNamespace(_pipeline=Pipeline())
    _bare_runner(runner_cls, adapter).load_model(load_format="dummy")
    assert seen == [adapter._pipeline]


@pytest.mark.parametrize("error", [RuntimeError("boom"),
                                   HookRefused(Reason("target moved", "use another version"))])
def test_hook_that_raises_leaves_load_succeeding_and_is_logged(monkeypatch, runner_cls, vllm_log,
                                                               error):
    def wire(target, cfg, runner):
        raise error

    _install_hook(monkeypatch, "sensenova_u1", _hook("test", wire))
    loading.patch_runner_class(runner_cls)
    pipeline = Pipeline()
    assert _bare_runner(runner_cls, pipeline).load_model(load_format="dummy") is None
    out = _vllm_output(vllm_log)
    assert "not wired" in out and str(error) in out
    assert sum(stats.fallbacks("sensenova_u1").values()) == 1


def test_unclaimed_pipeline_logs_why_nothing_was_wired(monkeypatch, runner_cls, vllm_log):
    _install_hook(monkeypatch, "sensenova_u1", _hook("other", lambda *a: "never"))
    loading.patch_runner_class(runner_cls)
    _bare_runner(runner_cls, Pipeline()).load_model(load_format="dummy")
    assert "Pipeline is not a model this plugin accelerates" in _vllm_output(vllm_log)


def test_moved_load_model_signature_is_refused_and_left_alone(vllm_log):
    class MovedRunner:
        def load_model(self, load_format="default"):
            return "real load"

    original = MovedRunner.load_model
    assert loading.patch_runner_class(MovedRunner) is False
    assert MovedRunner.load_model is original
    assert MovedRunner().load_model() == "real load"
    assert "load_model moved" in _vllm_output(vllm_log)
    assert "(self, load_format)" in _vllm_output(vllm_log)  # the detail says what it found
    assert stats.fallbacks("plugin") == {f"plugin: {loading.LOAD_MOVED.key}": 1}


@pytest.mark.parametrize("version,ok", [("0.24.0", True), ("0.26.1", True), ("0.28.0", True),
                                        ("0.30.0", True), ("0.22.0", False), ("0.32.0", False),
                                        (None, False)])
def test_unsupported_vllm_omni_version_is_a_warning_text_not_a_crash(version, ok):
    problem = loading.check_omni_version(version)
    assert (problem is None) is ok
    if version and not ok:
        assert version in problem and "0.24.x" in problem and "0.30.x" in problem


def test_two_refusals_with_different_details_count_under_one_stable_key(monkeypatch, runner_cls,
                                                                       vllm_log):
    reason = Reason("target moved", "use another version")
    details = iter(["first place", "second place"])

    def wire(target, cfg, runner):
        raise HookRefused(reason.because(next(details)))

    _install_hook(monkeypatch, "sensenova_u1", _hook("test", wire))
    loading.patch_runner_class(runner_cls)
    for _ in range(2):
        _bare_runner(runner_cls, Pipeline()).load_model(load_format="dummy")
    assert stats.fallbacks("sensenova_u1") == {"sensenova_u1: target moved": 2}
    out = _vllm_output(vllm_log)
    assert "first place" in out and "second place" in out  # each load line says its own detail
    warnings = [r for r in vllm_log if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "use another version" in warnings[0].getMessage()


def test_registry_is_the_one_list_config_and_doctor_read():
    """One list (``models.MODELS``): config and the hooks package read the same objects, and
    config imports nothing from the hooks above it."""
    import ast
    import inspect

    from vllm_omni_graphdecode import models

    assert config.MODEL_KEYS is models.MODEL_KEYS and hooks.MODELS is models.MODELS
    assert hooks.MODEL_KEYS is models.MODEL_KEYS
    assert set(config.MODEL_KEYS) == {m.key for m in hooks.MODELS}
    for model in hooks.MODELS:
        assert hooks.load(model.key).MODEL == model.key
        assert model.key in config.parse({"VLLM_OMNI_GRAPHDECODE": "all"}).models
    imported = set()
    for node in ast.walk(ast.parse(inspect.getsource(config))):
        if isinstance(node, ast.ImportFrom):  # "from .hooks import X" or "from . import hooks"
            imported.add(node.module or "")
            imported.update(a.name for a in node.names if node.module is None)
        elif isinstance(node, ast.Import):
            imported.update(a.name for a in node.names)
    assert not any("hooks" in name.split(".") for name in imported), imported
