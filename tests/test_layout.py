"""The package's layering, read from its source (CONTRIBUTING.md, "Where things live"): no import
cycle between its modules, mechanism (``core/``, ``graphs/``, ``decode/``, ``ops/``) that imports
no hook and no test scaffolding and names no model, and ``core/`` that knows nothing above it.

Every import counts, a function's lazy one too: a cycle broken only by importing late is still a
cycle in the design. A package's own ``__init__`` is an edge only where it is imported itself (a
name it defines); importing a submodule is an edge to that submodule.
"""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "vllm_omni_graphdecode"
MECHANISM = ("core", "graphs", "decode", "ops")
MODEL_WORDS = ("sensenova", "qwen")
# What ``core/`` may import besides itself: the environment (config) and the model list it reads.
CORE_MAY_IMPORT = ("config", "models")


def _modules() -> dict[str, tuple[str, bool]]:
    """module name -> (path, is a package's ``__init__``), for every file of the package."""
    found = {}
    for folder, dirs, files in os.walk(os.path.join(ROOT, PACKAGE)):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            parts = os.path.relpath(path, ROOT)[:-3].split(os.sep)
            is_init = parts[-1] == "__init__"
            found[".".join(parts[:-1] if is_init else parts)] = (path, is_init)
    return found


MODULES = _modules()


def _imports(module: str) -> tuple[set[str], list[str]]:
    """(the package's modules ``module`` imports, the imports that resolve to none of them)."""
    path, is_init = MODULES[module]
    here = module.split(".") if is_init else module.split(".")[:-1]
    edges, unresolved = set(), []
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                    if alias.name in MODULES:
                        edges.add(alias.name)
                    else:
                        unresolved.append(f"import {alias.name} (line {node.lineno})")
            continue
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = here[:len(here) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else []))
        elif node.module == PACKAGE or (node.module or "").startswith(PACKAGE + "."):
            target = node.module
        else:
            continue
        for alias in node.names:
            if f"{target}.{alias.name}" in MODULES:  # a submodule
                edges.add(f"{target}.{alias.name}")
            elif target in MODULES:  # a name the module (or package __init__) defines
                edges.add(target)
            else:
                unresolved.append(f"from {'.' * node.level}{node.module or ''} import {alias.name}"
                                  f" (line {node.lineno})")
    edges.discard(module)
    return edges, unresolved


GRAPH = {m: _imports(m)[0] for m in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def _mechanism() -> list[str]:
    return sorted(m for m in MODULES if _layer(m) in MECHANISM)


def test_the_cycle_finder_finds_a_cycle_through_three_modules():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_every_import_inside_the_package_resolves_to_one_of_its_modules():
    wrong = {m: bad for m in MODULES for bad in [_imports(m)[1]] if bad}
    assert wrong == {}


def test_no_two_modules_of_the_package_import_each_other_through_any_chain():
    assert _cycles(GRAPH) == [], "import cycles (each list: the modules of one cycle)"


def test_the_mechanism_layers_exist_and_hold_modules():
    for layer in MECHANISM:
        assert os.path.isfile(os.path.join(ROOT, PACKAGE, layer, "__init__.py")), layer
    assert {_layer(m) for m in _mechanism()} == set(MECHANISM)


def test_mechanism_imports_no_hook_and_no_test_scaffolding():
    upward = {m: sorted(t for t in GRAPH[m] if _layer(t) in ("hooks", "testing"))
              for m in _mechanism()}
    assert {m: t for m, t in upward.items() if t} == {}
    by_name = [m for m in _mechanism() for layer in ("hooks", "testing")
               if f"{PACKAGE}.{layer}" in open(MODULES[m][0]).read()]
    assert by_name == [], "a module path named as a string (importlib) is an import too"


def test_core_imports_only_core_config_and_the_model_list():
    allowed = {f"{PACKAGE}.{name}" for name in CORE_MAY_IMPORT}
    wrong = {m: sorted(t for t in GRAPH[m] if _layer(t) != "core" and t not in allowed)
             for m in MODULES if _layer(m) == "core"}
    assert {m: t for m, t in wrong.items() if t} == {}


@pytest.mark.parametrize("module", _mechanism())
def test_a_mechanism_module_names_no_model(module):
    """Code, comments and docstrings alike: a hook hands its model's names, shapes and variables
    down; a measurement says which model it was taken on in docs/, not here."""
    text = open(MODULES[module][0]).read().lower()
    named = [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1)
             for word in MODEL_WORDS if word in line]
    assert named == []
