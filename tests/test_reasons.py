"""One key per meaning: every ``Reason`` the plugin defines, across mechanisms and hooks, so a
fallback counted for one model sums with the same fallback of another (stats keys are
"<model>: <reason key>")."""

from __future__ import annotations

import importlib
import pkgutil

import vllm_omni_graphdecode
from vllm_omni_graphdecode.core import reasons
from vllm_omni_graphdecode.core.reasons import Reason

# Meanings more than one hook or mechanism meets, the words a key with that meaning has, and the
# one shared Reason that must carry it.
SHARED = {
    "NOT_CUDA": ("not cuda", "cuda device"),
    "AUTOGRAD": ("autograd",),
    "OOM": ("out of memory", "out of device memory"),
    "CAPTURE_FAILED": ("capture failed", "capture of the"),
    "RELEASED": ("released",),
    "PARALLEL": ("parallel",),
    "LORA": ("lora",),
    "QUANT_KV": ("quantized", "quant"),
    "OFFLOAD": ("offload",),
    "HOOKS": ("forward hook",),
    "COMPILED": ("compile'd",),
    "STRUCTURE": ("differ from what", "differs from diffusers"),
    "FAST_NOT_HERE": ("not applicable",),
    "ARGUMENTS": ("arguments this hook", "in a form this hook"),
}
# The names hooks exported before these were shared, kept as aliases of the shared object.
ALIASES = {"TP": "PARALLEL", "KV_QUANT": "QUANT_KV", "HOOKED": "HOOKS"}


def _modules():
    found = [vllm_omni_graphdecode]
    for info in pkgutil.walk_packages(vllm_omni_graphdecode.__path__, "vllm_omni_graphdecode."):
        if info.name.endswith("__main__"):
            continue
        found.append(importlib.import_module(info.name))
    return found


def _every_reason():
    """(module name, attribute, Reason) for every module-level Reason of the package."""
    return [(m.__name__, name, value) for m in _modules() for name, value in vars(m).items()
            if isinstance(value, Reason)]


def test_every_reason_key_belongs_to_one_reason():
    by_key: dict[str, dict[int, str]] = {}
    for module, name, reason in _every_reason():
        by_key.setdefault(reason.key, {})[id(reason)] = f"{module}.{name}"
    doubled = {key: sorted(where.values()) for key, where in by_key.items() if len(where) > 1}
    assert doubled == {}, "one key, several Reason objects (define it once and import it)"


def test_a_meaning_two_hooks_share_is_the_shared_reason_wherever_it_is_met():
    wrong = []
    for module, name, reason in _every_reason():
        shared = [n for n, words in SHARED.items()
                  if any(w in reason.key.lower() for w in words)]
        canonical = ALIASES.get(name, name) if module != reasons.__name__ else name
        if canonical in SHARED and canonical not in shared:
            shared.append(canonical)
        for meaning in shared:
            if reason is getattr(reasons, meaning):
                continue
            wrong.append(f"{module}.{name} ({reason.key!r}) means reasons.{meaning}")
    assert wrong == []


def test_hooks_and_mechanisms_export_the_shared_objects():
    from vllm_omni_graphdecode.graphs import prefix as prefix_graph
    from vllm_omni_graphdecode.hooks import qwen_image_21 as qwen
    from vllm_omni_graphdecode.hooks.qwen_image_21 import cached_step, fast_step
    from vllm_omni_graphdecode.hooks.sensenova_u1 import denoise, fast_denoise, rules
    from vllm_omni_graphdecode.ops import attention as kernels, layer_ops

    assert kernels.NOT_CUDA is layer_ops.NOT_CUDA is qwen.NOT_CUDA is denoise.NOT_CUDA \
        is reasons.NOT_CUDA
    assert qwen.AUTOGRAD is denoise.AUTOGRAD is reasons.AUTOGRAD
    assert prefix_graph.OOM is reasons.OOM and prefix_graph.CAPTURE_FAILED is reasons.CAPTURE_FAILED
    assert qwen.LORA is denoise.LORA is reasons.LORA
    assert qwen.PARALLEL is denoise.PARALLEL is rules.TP is reasons.PARALLEL
    assert qwen.QUANT_KV is denoise.QUANT_KV is rules.KV_QUANT is reasons.QUANT_KV
    assert qwen.OFFLOAD is rules.OFFLOAD is reasons.OFFLOAD
    assert qwen.HOOKS is rules.HOOKED is reasons.HOOKS
    assert qwen.COMPILED is rules.COMPILED is reasons.COMPILED
    assert fast_step.STRUCTURE is fast_denoise.STRUCTURE is reasons.STRUCTURE
    assert cached_step.FAST_NOT_HERE is denoise.FAST_NOT_HERE is reasons.FAST_NOT_HERE
    assert cached_step.ARGUMENTS is denoise.ARGUMENTS is reasons.ARGUMENTS


def test_a_hook_adds_its_case_as_detail_and_the_key_stays_shared():
    specific = reasons.NOT_CUDA.because("device is cpu")
    assert specific.key == reasons.NOT_CUDA.key and specific.hint == reasons.NOT_CUDA.hint
    assert reasons.NOT_CUDA.same(specific) and specific.detail == "device is cpu"
