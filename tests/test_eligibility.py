"""``eligibility.scan`` on the real SenseNova-U1 module tree: every obstacle a hook, an offloader,
a compiler or a wrapper leaves on one nested module is reported with its place, and the fast
per-module check the walk starts with (``_quiet``) agrees with the full checks on every module.

The walk runs once per request (``rules.verdict``), so it reads each module's instance dict
and class before any ``getattr`` (see ``eligibility._quiet``); these tests pin that it still sees
what the ``getattr`` checks see.
"""

import pytest
import torch

from vllm_omni_graphdecode import eligibility
from vllm_omni_graphdecode.testing import random_models as st

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
