"""``eligibility.scan`` on the real SenseNova-U1 module tree: every obstacle a hook, an offloader,
a compiler or a wrapper leaves on one nested module is reported with its place, and the fast
per-module check the walk starts with (``_quiet``) agrees with the full checks on every module.

The walk runs at a request's bind, or after a change (``rules.verdict``), so it reads each
module's instance dict and class before any ``getattr`` (see ``eligibility._quiet``); these tests
pin that it still sees what the ``getattr`` checks see. ``Watch``, checked instead of the walk at
every step: what it sees (weights moved, hooks, attributes scan reads), what it must not see (a
module's own attributes), and that it leaves nothing behind (pickle, deep copy, disarm).
"""

import collections

import pytest
import torch

from vllm_omni_graphdecode.core import eligibility
from vllm_omni_graphdecode.testing import sensenova as st

PLACE = "model.layers.1.mlp"


def _accelerate_hook(module):
    hooks = pytest.importorskip("accelerate.hooks")
    hooks.add_hook_to_module(module, hooks.ModelHook())


def _diffusers_hook(module):
    from diffusers.hooks import HookRegistry, ModelHook

    HookRegistry.check_if_exists_or_initialize(module).register_hook(ModelHook(), "probe")


def _omni_offload_hook(module):
    from vllm_omni.diffusion.hooks import HookRegistry, ModelHook
    from vllm_omni.diffusion.offloader.layerwise_backend import LayerwiseOffloadHook

    HookRegistry.get_or_create(module).register_hook(LayerwiseOffloadHook._HOOK_NAME, ModelHook())


def _replaced_forward(module):
    inner = module.forward
    module.forward = lambda *a, **k: inner(*a, **k)


class BaseLayerWithLoRA(torch.nn.Module):  # vLLM's wrapper base, matched by class name
    def __init__(self, base):
        super().__init__()
        self.base = base


class FSDPModule(torch.nn.Module):  # torch's fully_shard class prefix
    pass


def _wrap(parent_name, child_name, cls):
    def attach(lm):
        parent = lm.get_submodule(parent_name)
        setattr(parent, child_name, cls(getattr(parent, child_name)) if cls is BaseLayerWithLoRA
                else cls())
    return attach


# (what is attached to PLACE, the Structure field it must fill, a fragment of the report)
ON_THE_MODULE = [
    ("accelerate hook", _accelerate_hook, "hooks", "accelerate ModelHook on " + PLACE),
    ("diffusers hook", _diffusers_hook, "hooks", "diffusers hook probe on " + PLACE),
    ("vllm-omni offload hook", _omni_offload_hook, "offload", "vllm-omni hook"),
    ("torch forward pre-hook", lambda m: m.register_forward_pre_hook(lambda *a: None), "hooks",
     "torch forward hook on " + PLACE),
    ("torch forward hook", lambda m: m.register_forward_hook(lambda *a: None), "hooks",
     "torch forward hook on " + PLACE),
    ("replaced forward", _replaced_forward, "hooks", "replaced forward (function) on " + PLACE),
    ("module.compile()", lambda m: m.compile(backend="eager"), "compiled", PLACE),
    ("quantized K/V dtype", lambda m: setattr(m, "_kv_cache_dtype", "fp8"), "kv_cache_dtype",
     "fp8 on " + PLACE),
]

WRAPPED = [
    ("LoRA wrapper", _wrap("model.layers.1.self_attn", "o_proj", BaseLayerWithLoRA), "lora",
     "model.layers.1.self_attn.o_proj is BaseLayerWithLoRA"),
    ("FSDP wrapper", _wrap("model.layers.1", "mlp", FSDPModule), "sharded",
     "model.layers.1.mlp is FSDPModule"),
]

FIELDS = ("offload", "hooks", "compiled", "lora", "sharded", "kv_cache_dtype")


def _full_checks_find_something(module) -> bool:
    """What ``scan`` reports for ``module`` itself, through the detailed checks alone."""
    dtype = getattr(module, "_kv_cache_dtype", None)
    return bool(eligibility.module_hooks(module) or eligibility.compiled(module)
                or eligibility.lora_wrapper(module) or eligibility.fsdp(module)
                or dtype not in (None, "auto", "float"))


def _check(lm, field, fragment):
    found = eligibility.scan(lm, "language_model")
    assert getattr(found, field) is not None and fragment in getattr(found, field), found
    assert all(getattr(found, other) is None for other in FIELDS if other != field), found
    for name, module in lm.named_modules():
        assert eligibility._quiet(module) is not _full_checks_find_something(module), name


def test_a_plain_model_reports_nothing_and_every_module_is_quiet():
    lm = st.build_lm()
    found = eligibility.scan(lm, "language_model")
    assert all(getattr(found, f) is None for f in FIELDS), found
    assert all(eligibility._quiet(m) for m in lm.modules())


@pytest.mark.parametrize("what,attach,field,fragment", ON_THE_MODULE,
                         ids=[case[0] for case in ON_THE_MODULE])
def test_an_obstacle_on_a_nested_module_is_reported_at_its_place(what, attach, field, fragment):
    lm = st.build_lm()
    attach(lm.get_submodule(PLACE))
    _check(lm, field, fragment)


@pytest.mark.parametrize("what,attach,field,fragment", WRAPPED, ids=[case[0] for case in WRAPPED])
def test_a_wrapper_class_is_reported_at_its_place(what, attach, field, fragment):
    lm = st.build_lm()
    attach(lm)
    _check(lm, field, fragment)


def test_a_class_level_value_counts_like_an_instance_one():
    """The fast check reads the class too, as ``getattr`` does: a module class that declares a
    quantized K/V dtype for all its instances is reported."""
    lm = st.build_lm()
    mlp = lm.get_submodule(PLACE)
    quantized = type("QuantizedKVMLP", (type(mlp),), {"_kv_cache_dtype": "fp8_e4m3"})
    mlp.__class__ = quantized
    _check(lm, "kv_cache_dtype", "fp8_e4m3 on " + PLACE)


def test_the_global_forward_hook_is_reported_before_any_module():
    lm = st.build_lm()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *a: None)
    try:
        found = eligibility.scan(lm)
    finally:
        handle.remove()
    assert found.hooks == "global torch forward hook"
    assert eligibility.scan(lm).hooks is None


def test_an_instance_value_of_auto_is_no_obstacle():
    """vllm-omni's attention layers carry ``_kv_cache_dtype`` as None or "auto" when the cache is
    not quantized."""
    lm = st.build_lm()
    for module in lm.modules():
        module._kv_cache_dtype = "auto"
    found = eligibility.scan(lm)
    assert found.kv_cache_dtype is None
    assert all(eligibility._quiet(m) for m in lm.modules())


# -- Watch: what a step checks in constant time between two walks -------------------------------

PROJ = "model.layers.1.self_attn.qkv_proj"


def _armed(*roots):
    watch = eligibility.Watch(*roots)
    watch.arm()
    return watch


def test_a_to_round_trip_that_moves_the_weights_is_seen_and_one_that_moves_nothing_is_not():
    """``Module._apply`` rewrites ``param.data`` in place (the same Parameter on new storage), so
    no table changes: the watch sees it through ``moved``. A conversion to where a tensor
    already is (same device, same dtype) returns it unchanged and counts as no change."""
    lm = st.build_lm()
    weight = lm.get_submodule(PROJ).weight
    watch = _armed(lm)
    lm.to("cpu")
    lm.float()
    assert not watch.changed()
    lm.to(torch.float64)  # new storage for every weight
    assert lm.get_submodule(PROJ).weight is weight  # same Parameter: only moved() can tell
    assert watch.changed() and watch.moved()
    watch.settle()
    lm.to(torch.float32)
    assert watch.changed() and watch.moved()
    watch.settle()
    lm.get_submodule("model.layers.1.mlp").double()  # one inner module on its own
    assert watch.moved()


def _scaling_hook(calls):
    hooks = pytest.importorskip("accelerate.hooks")

    class Scale(hooks.ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            calls.append(1)
            return tuple(a * 1.5 for a in args), kwargs

    return hooks, Scale()


def test_an_accelerate_hook_added_to_one_inner_projection_is_seen():
    calls = []
    hooks, hook = _scaling_hook(calls)
    lm = st.build_lm()
    watch = _armed(lm)
    proj = lm.get_submodule(PROJ)
    hooks.add_hook_to_module(proj, hook)
    assert watch.changed() and not watch.moved()
    assert eligibility.scan(lm).hooks == f"accelerate Scale on {PROJ}"
    watch.settle()
    hooks.remove_hook_from_module(proj)
    assert watch.changed()


def test_a_diffusers_hook_registry_put_on_a_module_is_seen():
    from diffusers.hooks import HookRegistry, ModelHook

    lm = st.build_lm()
    watch = _armed(lm)
    HookRegistry.check_if_exists_or_initialize(lm.get_submodule(PROJ)).register_hook(
        ModelHook(), "probe")
    assert watch.changed()


def test_a_hook_registered_on_a_vllm_omni_registry_already_there_is_seen():
    """vllm-omni's registry replaces ``forward`` once, when it is created; a hook registered on
    it later writes only the registry's table, which the watch observes."""
    from vllm_omni.diffusion.hooks import HookRegistry, ModelHook

    lm = st.build_lm()
    module = lm.get_submodule(PROJ)
    registry = HookRegistry.get_or_create(module)  # at load, with its hooks removed since
    forward = vars(module)["forward"]
    watch = _armed(lm)
    registry.register_hook("cache", ModelHook())
    assert vars(module)["forward"] is forward  # no attribute written: the table told
    assert watch.changed()
    assert eligibility.scan(lm).hooks == f"vllm-omni hook cache on {PROJ}"


@pytest.mark.parametrize("what,change", [
    ("module.compile()", lambda m: m.compile(backend="eager")),
    ("quantized K/V dtype", lambda m: setattr(m, "_kv_cache_dtype", "fp8")),
    ("replaced forward", lambda m: setattr(m, "forward", lambda *a, **k: None)),
    ("class swap", lambda m: setattr(m, "__class__", type("Swapped", (type(m),), {}))),
    ("a parameter replaced", lambda m: setattr(m, "weight", torch.nn.Parameter(m.weight + 0))),
    ("a torch forward hook", lambda m: m.register_forward_hook(lambda *a: None)),
], ids=lambda v: v if isinstance(v, str) else "")
def test_each_change_scan_would_report_differently_is_seen(what, change):
    lm = st.build_lm()
    watch = _armed(lm)
    change(lm.get_submodule(PROJ))
    assert watch.changed(), what


def test_attributes_a_module_writes_for_itself_are_no_change():
    """A module caching a value during its forward, ``eval()``, a watched attribute set to the
    object it holds: none of them drops a graph."""
    lm = st.build_lm()
    proj = lm.get_submodule(PROJ)
    proj._kv_cache_dtype = "auto"
    watch = _armed(lm)
    for step in range(3):
        proj.last_rows = torch.zeros(step + 1)
        lm.model.layers[0].seen = step
        proj._kv_cache_dtype = "auto"  # a watched attribute set to the object it holds
    lm.eval()
    del proj.last_rows
    assert not watch.changed()


def test_changed_reads_no_module_tree(monkeypatch):
    lm = st.build_lm()
    watch = _armed(lm)
    walks = []
    monkeypatch.setattr(torch.nn.Module, "named_modules",
                        lambda self, *a, **k: walks.append(1) or iter(()))
    monkeypatch.setattr(torch.nn.Module, "modules", lambda self: walks.append(1) or iter(()))
    for _ in range(3):
        assert not watch.changed()
    assert walks == []


def test_an_armed_model_pickles_and_deep_copies_as_plain_modules():
    """``torch.save(model)`` of a watched model loads without this plugin, and a deep copy is a
    model nobody watches: its changes are not the original's."""
    import copy
    import io
    import pickle

    # torch's own modules: vLLM's parameters cannot be deep-copied at all
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    model[0].register_forward_hook(_no_op_hook)
    watch = _armed(model)
    torch.save(model, io.BytesIO())
    assert b"vllm_omni_graphdecode" not in pickle.dumps(model)
    clone = copy.deepcopy(model)
    assert all(type(vars(m)[t]) in (dict, collections.OrderedDict)
               for m in clone.modules() for t in eligibility._WATCHED)
    clone.to(torch.float64)
    clone[0].forward = lambda *a, **k: None
    clone[1].weight = torch.nn.Parameter(torch.zeros(4))
    assert not watch.changed()
    clone[0]._forward_hooks.clear()
    assert not watch.changed() and len(model[0]._forward_hooks) == 1


def _no_op_hook(module, args, output):  # module level: a forward hook that pickles
    return None


def test_disarm_puts_every_table_back_and_nothing_counts_after():
    lm = st.build_lm()
    tables = [(m, t, vars(m)[t]) for m in lm.modules() for t in eligibility._WATCHED]
    watch = _armed(lm)
    watch.disarm()
    assert all(vars(m)[t] is table for m, t, table in tables)
    assert all(eligibility._stamps_of(m) == () for m in lm.modules())
    lm.to(torch.float64)
    lm.get_submodule(PROJ).forward = lambda *a, **k: None
    assert not watch.changed()


def test_two_watches_on_one_model_each_see_a_change_and_one_disarmed_leaves_the_other():
    lm = st.build_lm()
    first, second = _armed(lm), _armed(lm)
    lm.to(torch.float64)
    assert first.moved() and second.moved()
    first.settle()
    second.settle()
    first.disarm()
    lm.get_submodule(PROJ)._kv_cache_dtype = "fp8"
    lm.to(torch.float32)
    assert not first.changed() and second.changed() and second.moved()


def test_a_module_added_after_arming_is_seen_added_and_watched_after_the_next_arm():
    lm = st.build_lm()
    watch = _armed(lm)
    extra = torch.nn.Linear(2, 2)
    lm.model.extra = extra
    assert watch.changed()
    watch.settle()
    extra.to(torch.float64)
    assert not watch.changed()  # not armed yet: the documented blind spot
    watch.arm()
    extra.to(torch.float32)
    assert watch.changed() and watch.moved()


def test_the_wrapped_module_methods_are_installed_once_and_keep_their_signatures():
    import inspect

    eligibility.Watch(torch.nn.Linear(1, 1))
    methods = {name: vars(torch.nn.Module)[name] for name in eligibility._MODULE_METHODS}
    eligibility.Watch(torch.nn.Linear(1, 1))
    assert {name: vars(torch.nn.Module)[name] for name in methods} == methods
    for name, fn in methods.items():
        assert eligibility._is_ours(fn)
        assert inspect.signature(fn) == inspect.signature(fn.__wrapped__), name
        assert not eligibility._is_ours(fn.__wrapped__)
