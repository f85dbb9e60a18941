"""What a loaded module tree carries that a captured step cannot replay: the shared predicates.

A CUDA graph replays the kernels recorded at capture. Anything that changes what a forward does
between calls without changing a tensor's shape is invisible to it: a hook (runs once during
capture, never at replay), offload (moves weights between calls: the graph would read storage
that moved), a dynamic LoRA wrapper (switches adapters by Python branches the capture froze),
torch.compile (Dynamo would trace our step), sharded parameters. ``scan`` walks a module tree once
and reports the first of each; each hook turns what it cares about into its own ``Reason``.

``fingerprint`` is the cheap per-step version: a tuple that changes whenever a module is added,
replaced, hooked, unhooked or compiled, so a hook can notice a change in the middle of a request
without rescanning (the Qwen-Image-2.1 hook compares it at every cached step).
"""

from __future__ import annotations

import dataclasses

import torch

# Class names, not imports: the libraries are optional and may be absent.
_LORA_CLASSES = ("BaseLayerWithLoRA", "BaseTunerLayer")  # vLLM's wrappers, peft's layers
_OFFLOAD_WORDS = ("offload",)


def _mro_names(obj) -> set[str]:
    return {c.__name__ for c in type(obj).__mro__}


def _own_bound_forward(module, fwd) -> bool:
    """``module.forward`` as the class defines it, bound to ``module``: what accelerate's
    ``remove_hook_from_module`` leaves in the instance dict after removing its hook."""
    return (getattr(fwd, "__self__", None) is module
            and getattr(fwd, "__func__", None) is getattr(type(module), "forward", None))


def replaced_forward(module) -> str | None:
    """What replaced ``module.forward`` on the instance, or None.

    None for vllm-omni's hook dispatcher (``_WrappedForward``: its hooks are read from the
    registry) and for the class's own forward bound to the module.
    """
    fwd = module.__dict__.get("forward")
    if fwd is None or type(fwd).__name__ == "_WrappedForward" or _own_bound_forward(module, fwd):
        return None
    if hasattr(fwd, "_torchdynamo_orig_callable"):  # torch.compile'd (vLLM-Omni's regional
        return None                                 # compile): reported as compiled, not a hook
    if getattr(fwd, "__graphdecode__", False):  # this plugin's own patched forward
        return None
    return type(fwd).__name__


def _accelerate_hooks(hook) -> list:
    inner = getattr(hook, "hooks", None)  # accelerate's SequentialHook
    if isinstance(inner, (list, tuple)):
        return [h for sub in inner for h in _accelerate_hooks(sub)]
    return [hook]


def _is_offload(name: str, hook=None) -> bool:
    # accelerate's sequential offload is an AlignDevicesHook(offload=True); its model offload is
    # CpuOffload; diffusers' group offloading and vllm-omni's offloaders say so in their names.
    return (any(w in name.lower() for w in _OFFLOAD_WORDS)
            or bool(getattr(hook, "offload", False) is True))


def module_hooks(module) -> list[tuple[str, bool]]:
    """Every hook on ``module`` itself, as (name, is_offload)."""
    found: list[tuple[str, bool]] = []
    hf = getattr(module, "_hf_hook", None)  # accelerate
    if hf is not None:
        for hook in _accelerate_hooks(hf):
            name = type(hook).__name__
            found.append((f"accelerate {name}", _is_offload(name, hook)))
    registry = getattr(module, "_diffusers_hook", None)  # diffusers' HookRegistry
    for name in sorted(getattr(registry, "hooks", None) or {}):
        found.append((f"diffusers hook {name}", _is_offload(name)))
    registry = getattr(module, "_hook_registry", None)  # vllm-omni's HookRegistry
    for name in sorted(getattr(registry, "_hooks", None) or {}):
        found.append((f"vllm-omni hook {name}", _is_offload(name)))
    if module._forward_hooks or module._forward_pre_hooks:
        found.append(("torch forward hook", False))
    replaced = replaced_forward(module)
    if replaced is not None:
        found.append((f"replaced forward ({replaced})", False))
    return found


def compiled(module) -> bool:
    fwd = module.__dict__.get("forward") or module.__dict__.get("_omni_original_forward")
    return (getattr(module, "_compiled_call_impl", None) is not None
            or type(module).__name__ == "OptimizedModule"
            or hasattr(fwd, "_torchdynamo_orig_callable"))


def lora_wrapper(module) -> bool:
    return bool(_mro_names(module) & set(_LORA_CLASSES))


def fsdp(module) -> bool:
    name = type(module).__name__
    return name == "FullyShardedDataParallel" or (name.startswith("FSDP") and name != "FSDP")


@dataclasses.dataclass
class Structure:
    """The first place (``"<what> on <module>"``) each kind of obstacle was found, or None."""

    offload: str | None = None
    hooks: str | None = None
    compiled: str | None = None
    lora: str | None = None
    sharded: str | None = None


def scan(root: torch.nn.Module, label: str | None = None) -> Structure:
    """Walk ``root`` once; ``label`` names the root in the report (default: its class)."""
    found = Structure()
    if torch.nn.modules.module._global_forward_hooks or \
            torch.nn.modules.module._global_forward_pre_hooks:
        found.hooks = "global torch forward hook"
    for name, module in root.named_modules():
        where = name or label or type(root).__name__
        for hook, offload in module_hooks(module):
            if offload and found.offload is None:
                found.offload = f"{hook} on {where}"
            elif not offload and found.hooks is None:
                found.hooks = f"{hook} on {where}"
        if found.compiled is None and compiled(module):
            found.compiled = where
        if found.lora is None and lora_wrapper(module):
            found.lora = f"{where} is {type(module).__name__}"
        if found.sharded is None and fsdp(module):
            found.sharded = f"{where} is {type(module).__name__}"
    return found


def fingerprint(root: torch.nn.Module) -> tuple:
    """A cheap summary of ``root``'s structure that changes when a module is added, replaced,
    hooked, unhooked, offloaded or compiled (not when weights change in place: a graph reads
    weights through their addresses, so new values are fine)."""
    parts = []
    for module in root.modules():
        d = module.__dict__
        registry = d.get("_diffusers_hook")
        omni = d.get("_hook_registry")
        parts.append((id(module), id(d.get("forward")), id(d.get("_hf_hook")),
                      len(getattr(registry, "hooks", None) or ()),
                      len(getattr(omni, "_hooks", None) or ()),
                      len(module._forward_hooks) + len(module._forward_pre_hooks),
                      d.get("_compiled_call_impl") is not None))
    parts.append((len(torch.nn.modules.module._global_forward_hooks),
                  len(torch.nn.modules.module._global_forward_pre_hooks)))
    return tuple(parts)
