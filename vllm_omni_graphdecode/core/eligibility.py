"""What a loaded module tree carries that a captured step cannot replay: the shared predicates.

A CUDA graph replays the kernels recorded at capture. Anything that changes what a forward does
between calls without changing a tensor's shape is invisible to it: a hook (runs once during
capture, never at replay), offload (moves weights between calls: the graph would read storage
that moved), a dynamic LoRA wrapper (switches adapters by Python branches the capture froze),
torch.compile (Dynamo would trace our step), sharded parameters. ``scan`` walks a module tree once
and reports the first of each; each hook turns what it cares about into a ``Reason`` (the shared
ones of ``reasons``, with the place in the detail).

``scan`` is a walk: a hook runs it when a request binds, or after ``Watch`` saw a change, never
per step. ``Watch`` is what a step checks instead, in constant time: it notices the changes
between two scans that a replay depends on and that go through torch's own paths (a child
module, parameter or buffer replaced, a torch hook, an instance hook set by accelerate or a hook
registry, ``module.compile()``, weights moved by ``module.to()``); its docstring lists what it
cannot see.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
import weakref

import torch

from . import patching

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
    of a 42-layer vllm language model on a CI CPU, 9.6 on the H200's host; 1.2 and 1.3 with this."""
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
    """What the watched modules of one ``Watch`` bump: ``version`` on a structure change (a table
    entry or a watched instance attribute set or removed), ``moved`` when ``_apply`` put one of
    their own parameters or buffers on other storage."""

    __slots__ = ("version", "moved")

    def __init__(self):
        self.version = 0
        self.moved = 0


_MISSING = object()


def _observing(base: type) -> type:
    class Observed(base):
        """A module's own table (children, parameters, buffers or forward hooks), or a hook
        registry's, unchanged but for bumping its watchers' stamps when an entry is set to
        another object or removed. Pickled and copied as the plain table it replaced: a
        ``torch.save(model)`` or ``copy.deepcopy(model)`` of a watched model carries nothing of
        this module, and a deep copy is not watched."""

        stamps: list | tuple = ()  # the instance's own list once armed (not while it is filled)

        def _bump(self):
            for stamp in self.stamps:
                stamp.version += 1

        def __reduce__(self):
            return base, (list(base.items(self)),)

        def __setitem__(self, key, value):
            # ``_apply`` writes every buffer back, most often the very tensor it held: no change.
            if base.get(self, key, _MISSING) is not value:
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
# A hook registered on a hook registry that is already there writes only the registry's table:
# (the module attribute holding the registry, the registry's table).
_REGISTRY_TABLES = (("_diffusers_hook", "hooks"), ("_hook_registry", "_hooks"))
# Instance attributes whose writes (set or deleted, on a watched module) are structure changes:
# what ``module_hooks``, ``compiled`` and the K/V dtype check read, the ``forward`` that
# accelerate's ``add_hook_to_module`` and the hook registries (diffusers', vllm-omni's) replace,
# and the class (a swap changes the forward and what the class says). Any other attribute a
# module writes, say one it caches during its forward, bumps nothing.
_WATCHED_ATTRS = frozenset(_INSTANCE_ATTRS + ("forward", "_omni_original_forward", "__class__"))

# id(module) -> (weak reference to it, the stamps of the watches that armed it): what the
# wrapped ``Module._apply``, ``__setattr__`` and ``__delattr__`` bump. Kept here, not in the
# module's instance dict, so that pickling or copying a watched module carries none of it.
_ARMED: dict[int, tuple[weakref.ref, list]] = {}
# Re-entrant: a weak reference's callback takes it, maybe from a collection run inside it.
_ARMED_LOCK = threading.RLock()


def _stamps_of(module) -> list | tuple:
    entry = _ARMED.get(id(module))
    if entry is None or entry[0]() is not module:  # not armed, or a dead module's reused id
        return ()
    return entry[1]


def _storage(module) -> list:
    """Where ``module``'s own parameters and buffers are: (name, address, dtype, device)."""
    d = module.__dict__
    found = []
    for table in (d.get("_parameters"), d.get("_buffers")):
        for name, t in (table or {}).items():
            if t is None:
                continue
            try:
                address = t.data_ptr()
            except RuntimeError:  # no storage to point at (a meta or wrapper tensor)
                address = None
            found.append((name, id(t), address, t.dtype, t.device))
    return found


# torch.nn.Module's methods a watch wraps, with the leading parameters each must have.
_MODULE_METHODS = {"_apply": ("self", "fn"), "__setattr__": ("self", "name", "value"),
                   "__delattr__": ("self", "name")}
_WRAP_LOCK = threading.Lock()


def _is_ours(fn) -> bool:
    for _ in range(16):  # follows wrappers stacked on ours (functools.wraps' __wrapped__)
        if fn is None:
            return False
        if getattr(fn, "__graphdecode_watch__", False):
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False


def _wrap_module_methods() -> None:
    """Wrap ``torch.nn.Module._apply``, ``__setattr__`` and ``__delattr__`` (once per process;
    idempotent) so that each bumps the stamps of the module it runs on, if a watch armed it.

    On the class, not on each instance: an instance-level ``_apply`` or ``forward`` wrapper would
    sit in every module's instance dict, where ``torch.save(model)`` pickles it and
    ``copy.deepcopy`` copies it to a model nobody watches. The cost for every module in the
    process: ``__setattr__`` tests the name against a frozenset (a module caching a value during
    its forward pays that and nothing else); ``_apply`` (``.to()``, ``.cuda()``, ``.half()``) a
    dict lookup. Raises HookRefused when torch moved one of them."""
    cls = torch.nn.Module
    with _WRAP_LOCK:
        todo = [name for name in _MODULE_METHODS if not _is_ours(cls.__dict__.get(name))]
        if not todo:
            return
        originals = {name: patching.check_signature(cls, name, _MODULE_METHODS[name])
                     for name in todo}
        for name, original in originals.items():
            wrapper = _WRAPPERS[name](original)
            wrapper.__graphdecode_watch__ = True
            setattr(cls, name, wrapper)


def _wrap_apply(apply):
    @functools.wraps(apply)
    def _apply(self, fn, *args, **kwargs):
        stamps = _stamps_of(self)
        if not stamps:
            return apply(self, fn, *args, **kwargs)
        before = _storage(self)
        try:
            return apply(self, fn, *args, **kwargs)
        finally:
            # ``.to()`` rewrites ``param.data`` in place: the same Parameter on new storage, which
            # a graph captured before would not read. A call that moved nothing bumps nothing.
            if _storage(self) != before:
                for stamp in stamps:
                    stamp.moved += 1
    return _apply


def _wrap_setattr(setattr_):
    @functools.wraps(setattr_)
    def __setattr__(self, name, value):
        # Traced by Dynamo (a compiled forward writing an attribute): the plain write.
        if name not in _WATCHED_ATTRS or torch.compiler.is_compiling():
            return setattr_(self, name, value)
        before = type(self) if name == "__class__" else self.__dict__.get(name, _MISSING)
        setattr_(self, name, value)
        if before is not value:
            for stamp in _stamps_of(self):
                stamp.version += 1
    return __setattr__


def _wrap_delattr(delattr_):
    @functools.wraps(delattr_)
    def __delattr__(self, name):
        delattr_(self, name)
        if name in _WATCHED_ATTRS and not torch.compiler.is_compiling():
            for stamp in _stamps_of(self):
                stamp.version += 1
    return __delattr__


_WRAPPERS = {"_apply": _wrap_apply, "__setattr__": _wrap_setattr, "__delattr__": _wrap_delattr}


class Watch:
    """Whether the structure of module trees, or where their weights live, changed since
    ``settle()``: ``changed()`` in constant time per check.

    ``Watch(root, *more)`` wraps three of ``torch.nn.Module``'s methods once per process
    (``_wrap_module_methods``; HookRefused if torch moved them). ``arm()`` walks the trees once:
    each module's children, parameters, buffers and forward-hook tables, and the hook table of a
    hook registry on it, get an observing copy (same type, same entries; a table already observed
    gets this watch's stamp too), and the module is registered for the wrapped methods; then it
    settles. ``changed()`` compares two version numbers and the global hook counts; ``moved()``
    says whether weights moved. Arm again after a change: modules added since are then watched
    too (the change that added them was seen).

    Seen at once, anywhere in the armed trees:
    - a child module added, replaced or removed (peft's and vLLM's LoRA wrappers), a parameter or
      buffer replaced;
    - a torch forward (pre-)hook added or removed, a global forward hook;
    - an instance attribute that ``scan`` reads set or deleted (``_WATCHED_ATTRS``): accelerate's
      ``add_hook_to_module`` (``_hf_hook`` and ``forward``), a diffusers or vllm-omni
      ``HookRegistry`` put on a module (``_diffusers_hook`` / ``_hook_registry`` and
      ``forward``), a hook registered on a registry that was already there (its table),
      ``module.compile()``, a class swap;
    - ``moved()``: ``module.to()``, ``.cuda()``, ``.cpu()``, ``.half()``, ``to_empty()`` (torch's
      ``Module._apply``) that put a parameter or buffer of an armed module on other storage.
      torch keeps the Parameter object and rewrites ``param.data``, so no table changes: a
      graph captured before would read the old addresses (``pipe.to("cpu");
      pipe.to("cuda")`` between two requests of a bare-diffusers user).

    Not seen (the remaining blind spots):
    - a weight rebound without ``_apply``: ``param.data = new`` or ``torch.utils.swap_tensors``
      called directly, as some weight reloaders do. Call the hook's release after such a reload
      (sleep level 2, ``release_captured_graphs``, does). Writes into a weight's own storage
      (``param.copy_()``, ``load_state_dict``, ``param.data.copy_()``) change no address: a graph
      reads the new values;
    - writes that bypass ``Module.__setattr__`` (``object.__setattr__(module, "forward", f)``),
      and class-level patches (``SomeLayer.forward = f``): ``scan`` does not see those either;
    - changes inside a module added after ``arm()``, until the next ``arm()``.
    Other attribute writes are not changes by design, and cost the name test only.

    ``disarm()`` puts every module's own tables back, with what they hold now, and unregisters
    the modules. A hook table that gained a hook while armed keeps its observing copy (the hook's
    handle removes it from there); it only stops counting for this watch. The wrapped methods
    stay, for the process.
    """

    def __init__(self, root: torch.nn.Module, *more: torch.nn.Module):
        _wrap_module_methods()
        self.root = root
        self.roots = (root, *more)
        self._stamp = _Stamp()
        self._armed: list[tuple[dict, str, dict]] = []  # (owner's __dict__, name, own table)
        self._registered: list[weakref.ref] = []  # the modules registered in _ARMED
        self.settle()

    @property
    def armed(self) -> bool:
        return bool(self._registered)

    def arm(self) -> None:
        for root in self.roots:
            for module in root.modules():
                d = module.__dict__
                for name in _WATCHED:
                    self._observe(d, name)
                for attr, name in _REGISTRY_TABLES:
                    registry = d.get(attr)
                    if registry is not None and hasattr(registry, "__dict__"):
                        self._observe(vars(registry), name)
                self._register(module)
        self.settle()

    def _observe(self, d: dict, name: str) -> None:
        table = d.get(name)
        stamps = getattr(table, "stamps", None)
        if stamps is not None:
            if self._stamp not in stamps:
                stamps.append(self._stamp)
            return
        observed = _OBSERVED.get(type(table))
        if observed is None:  # not the table torch (or the registry) made: leave it alone
            return
        copy = observed(table)
        copy.stamps = [self._stamp]
        d[name] = copy
        self._armed.append((d, name, table))

    def _register(self, module) -> None:
        key = id(module)
        with _ARMED_LOCK:
            entry = _ARMED.get(key)
            if entry is None or entry[0]() is not module:
                def forget(ref, key=key):
                    with _ARMED_LOCK:
                        if key in _ARMED and _ARMED[key][0] is ref:
                            del _ARMED[key]

                entry = _ARMED[key] = (weakref.ref(module, forget), [])
            if self._stamp not in entry[1]:
                entry[1].append(self._stamp)
                self._registered.append(entry[0])

    def settle(self) -> None:
        """Take the current structure, and where the weights are now, as the known ones."""
        self._seen = self._now()

    def changed(self) -> bool:
        return self._now() != self._seen

    def moved(self) -> bool:
        """Whether weights of the armed trees moved to other storage since ``settle()``."""
        return self._stamp.moved != self._seen[1]

    def _now(self) -> tuple:
        return (self._stamp.version, self._stamp.moved,
                len(torch.nn.modules.module._global_forward_hooks),
                len(torch.nn.modules.module._global_forward_pre_hooks))

    def disarm(self) -> None:
        with _ARMED_LOCK:
            for ref in self._registered:
                module = ref()
                entry = _ARMED.get(id(module)) if module is not None else None
                if entry is None or entry[0] is not ref:
                    continue
                if self._stamp in entry[1]:
                    entry[1].remove(self._stamp)
                if not entry[1]:
                    del _ARMED[id(module)]
        self._registered.clear()
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
