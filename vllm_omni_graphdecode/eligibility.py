"""What a loaded module tree carries that a captured step cannot replay: the shared predicates.

A CUDA graph replays the kernels recorded at capture. Anything that changes what a forward does
between calls without changing a tensor's shape is invisible to it: a hook (runs once during
capture, never at replay), offload (moves weights between calls: the graph would read storage
that moved), a dynamic LoRA wrapper (switches adapters by Python branches the capture froze),
torch.compile (Dynamo would trace our step), sharded parameters. ``scan`` walks a module tree once
and reports the first of each; each hook turns what it cares about into a ``Reason`` (the shared
ones of ``reasons``, with the place in the detail).

``scan`` is a walk: a hook runs it when a request binds, never per step. ``Watch`` is what a step
checks instead, in constant time: it notices the structure changes that happen through a module's
own tables (a child module replaced, a parameter replaced, a torch forward hook added) between two
scans.
"""

from __future__ import annotations

import collections
import dataclasses

import torch

# Class names, not imports: the libraries are optional and may be absent.
_LORA_CLASSES = ("BaseLayerWithLoRA", "BaseTunerLayer")  # vLLM's wrappers, peft's layers
_OFFLOAD_WORDS = ("offload",)


# Per class: (is a LoRA wrapper, is an FSDP wrapper). A class's bases are fixed once defined.
_CLASS_FACTS: dict[type, tuple[bool, bool]] = {}


def _class_facts(cls: type) -> tuple[bool, bool]:
    facts = _CLASS_FACTS.get(cls)
    if facts is None:
        name = cls.__name__
        facts = (bool({c.__name__ for c in cls.__mro__} & set(_LORA_CLASSES)),
                 name == "FullyShardedDataParallel" or (name.startswith("FSDP") and name != "FSDP"))
        _CLASS_FACTS[cls] = facts
    return facts


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
    return _class_facts(type(module))[0]


def fsdp(module) -> bool:
    return _class_facts(type(module))[1]


@dataclasses.dataclass
class Structure:
    """The first place (``"<what> on <module>"``) each kind of obstacle was found, or None."""

    offload: str | None = None
    hooks: str | None = None
    compiled: str | None = None
    lora: str | None = None
    sharded: str | None = None
    kv_cache_dtype: str | None = None  # a quantized K/V cache dtype some module carries


# The instance attributes ``module_hooks``, ``compiled`` and the K/V dtype check read.
_INSTANCE_ATTRS = ("_hf_hook", "_diffusers_hook", "_hook_registry", "_compiled_call_impl",
                   "_kv_cache_dtype")
_QUIET_CLASSES: dict[type, bool] = {}


def _quiet_class(cls: type) -> bool:
    """No class-level value of ``_INSTANCE_ATTRS`` or ``forward`` hook, not a LoRA, FSDP or
    compiled wrapper: only its instances' own attributes can put one of its modules in a report."""
    quiet = _QUIET_CLASSES.get(cls)
    if quiet is None:
        quiet = (not any(_class_facts(cls)) and cls.__name__ != "OptimizedModule"
                 and all(getattr(cls, a, None) in (None, "auto", "float") for a in _INSTANCE_ATTRS))
        _QUIET_CLASSES[cls] = quiet
    return quiet


def _quiet(module) -> bool:
    """True when ``scan`` has nothing to report on ``module`` itself: the checks below, read
    straight from the instance dict (what the hooks set there) and the class (``_quiet_class``).
    The walk runs at every request. Through ``getattr``, each attribute a module lacks went
    through ``nn.Module.__getattr__``, which raises and catches an AttributeError: 8.1 ms a walk
    of SenseNova-U1's language model on a CI CPU, 9.6 on the H200's host; 1.2 and 1.3 with this."""
    d = module.__dict__
    return (d.get("_hf_hook") is None and d.get("_diffusers_hook") is None
            and d.get("_hook_registry") is None and d.get("_compiled_call_impl") is None
            and d.get("_kv_cache_dtype") in (None, "auto", "float")
            and not d.get("_forward_hooks") and not d.get("_forward_pre_hooks")
            and "forward" not in d and "_omni_original_forward" not in d
            and _quiet_class(type(module)))


def scan(root: torch.nn.Module, label: str | None = None) -> Structure:
    """Walk ``root`` once; ``label`` names the root in the report (default: its class)."""
    found = Structure()
    if torch.nn.modules.module._global_forward_hooks or \
            torch.nn.modules.module._global_forward_pre_hooks:
        found.hooks = "global torch forward hook"
    for name, module in root.named_modules():
        if _quiet(module):
            continue
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
        if found.kv_cache_dtype is None:
            dtype = getattr(module, "_kv_cache_dtype", None)
            if dtype not in (None, "auto", "float"):
                found.kv_cache_dtype = f"{dtype} on {where}"
    return found


class _Stamp:
    """A version number that the watched tables of a module tree bump on every change."""

    def __init__(self):
        self.version = 0


def _observing(base: type) -> type:
    class Observed(base):
        """A module's own table (children, parameters, buffers or forward hooks), unchanged but
        for bumping its watchers' stamps when an entry is set or removed."""

        stamps: list | tuple = ()  # the instance's own list once armed (not while it is filled)

        def _bump(self):
            for stamp in self.stamps:
                stamp.version += 1

        def __setitem__(self, key, value):
            self._bump()
            base.__setitem__(self, key, value)

        def __delitem__(self, key):
            self._bump()
            base.__delitem__(self, key)

        def pop(self, *args):
            self._bump()
            return base.pop(self, *args)

        def popitem(self, *args):
            self._bump()
            return base.popitem(self, *args)

        def clear(self):
            self._bump()
            base.clear(self)

        def update(self, *args, **kwargs):
            self._bump()
            base.update(self, *args, **kwargs)

        def setdefault(self, *args):
            self._bump()
            return base.setdefault(self, *args)

    Observed.__name__ = Observed.__qualname__ = f"Observed{base.__name__}"
    return Observed


_OBSERVED = {dict: _observing(dict), collections.OrderedDict: _observing(collections.OrderedDict)}
# Module.__setattr__ / __delattr__ / register_* write children, parameters and buffers into these;
# register_forward_(pre_)hook and RemovableHandle.remove write the hook tables.
_WATCHED = ("_modules", "_parameters", "_buffers", "_forward_hooks", "_forward_pre_hooks")


class Watch:
    """Whether a module tree's structure changed since ``settle()``, in constant time per check.

    ``arm()`` walks the tree once and gives each module's children, parameters, buffers and
    forward-hook tables an observing copy (same type, same entries; a module already armed is
    skipped), then settles. ``changed()`` compares a version number and the global hook counts.

    Seen at once: a child module added, replaced or removed (peft's and vLLM's LoRA wrappers), a
    parameter or buffer replaced (accelerate moving weights, ``.to()``), a torch forward (pre-)hook
    added or removed anywhere in the tree, a global forward hook. Not seen until the next ``scan``
    (the next bind): an attribute set on a module instance, such as a ``forward`` replaced by
    accelerate's or diffusers' hook registries, or ``module.compile()``; in vLLM-Omni those are
    applied at load, or between requests.

    ``disarm()`` puts every module's own tables back, with what they hold now. A hook table that
    gained a hook while armed keeps its observing copy (the hook's handle removes it from there);
    it only stops counting for this watch.
    """

    def __init__(self, root: torch.nn.Module):
        self.root = root
        self._stamp = _Stamp()
        self._armed: list[tuple[dict, str, dict]] = []  # (module.__dict__, name, own table)
        self.settle()

    def arm(self) -> None:
        for module in self.root.modules():
            d = module.__dict__
            for name in _WATCHED:
                table = d.get(name)
                stamps = getattr(table, "stamps", None)
                if stamps is not None:
                    if self._stamp not in stamps:
                        stamps.append(self._stamp)
                    continue
                observed = _OBSERVED.get(type(table))
                if observed is None:  # not the table torch made: leave it alone
                    continue
                copy = observed(table)
                copy.stamps = [self._stamp]
                d[name] = copy
                self._armed.append((d, name, table))
        self.settle()

    def settle(self) -> None:
        """Take the current structure as the known one."""
        self._seen = self._now()

    def changed(self) -> bool:
        return self._now() != self._seen

    def _now(self) -> tuple:
        return (self._stamp.version, len(torch.nn.modules.module._global_forward_hooks),
                len(torch.nn.modules.module._global_forward_pre_hooks))

    def disarm(self) -> None:
        for d, name, table in reversed(self._armed):
            current = d.get(name)
            stamps = getattr(current, "stamps", None)
            if stamps is None:
                continue  # replaced since by someone else: theirs stays
            if self._stamp in stamps:
                stamps.remove(self._stamp)
            if name.endswith("hooks") and len(current) > len(table):
                continue  # a handle made while armed points at the copy
            table.clear()
            table.update(current)
            d[name] = table
        self._armed.clear()
