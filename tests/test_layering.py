"""Imports run downward only: rag_server -> cache_repair -> retrieval, and every one of them and
sglang_patches -> picrag_core, which imports none of them. So the frontend, retrieval and
training never import engine code (what they share with it is in picrag_core), and the engine
package holds only what runs inside SGLang. Inside the engine package, the folders by job import
one way too (sglang_patches/README.md), and no module imports itself through others.

Every module of the four lower packages is parsed (not imported), so an upward import hidden in
a function body or behind importlib is caught as well as one at the top of a file.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# The top-level packages each layer must never import.
FORBIDDEN = {
    "rag_server": {"sglang_patches"},
    "picrag_core": {"rag_server", "cache_repair", "retrieval", "sglang_patches"},
    "sglang_patches": {"rag_server", "cache_repair", "retrieval"},
    "retrieval": {"rag_server", "cache_repair", "sglang_patches"},
    "cache_repair": {"rag_server", "sglang_patches"},
}


def imported_modules(source: str, module: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in `source`, the text of module `module`
    (dotted, used to resolve relative imports), including importlib.import_module("...")."""
    package = module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            found.append((node.lineno, ".".join([*base, *(node.module or "").split(".")]).strip(".")))
        elif (isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name))
              and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id)
              in ("import_module", "__import__")
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.append((node.lineno, node.args[0].value))
    return sorted(found)


def upward_imports(layer: str, source: str, module: str) -> list[str]:
    return [f"line {line}: {name}" for line, name in imported_modules(source, module)
            if name.split(".")[0] in FORBIDDEN[layer]]


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_no_module_imports_a_layer_above_it(layer):
    files = sorted((REPO / layer).rglob("*.py"))
    assert len(files) >= 3, f"{layer}/ holds no modules to check"
    offences = {}
    for path in files:
        module = ".".join(path.relative_to(REPO).with_suffix("").parts)
        found = upward_imports(layer, path.read_text(), module)
        if found:
            offences[str(path.relative_to(REPO))] = found
    assert offences == {}


def test_the_check_sees_every_form_of_import():
    source = '''
"""Docstrings may name rag_server."""
import rag_server.api.app
from rag_server import dsl
from sglang_patches.chunk_key import chunk_key

def late():
    from cache_repair.pairs import PairMaker
    import importlib
    importlib.import_module("retrieval.embedder")
    __import__("rag_server.cli")

from . import positions
from .. import chunk_key as sibling
'''
    assert upward_imports("sglang_patches", source, "sglang_patches.repair.example") == [
        "line 3: rag_server.api.app", "line 4: rag_server", "line 8: cache_repair.pairs",
        "line 10: retrieval.embedder", "line 11: rag_server.cli",
    ]
    names = [name for _, name in imported_modules(source, "sglang_patches.repair.example")]
    assert names[-2:] == ["sglang_patches.repair", "sglang_patches"]
    assert upward_imports("cache_repair", source, "cache_repair.example") == [
        "line 3: rag_server.api.app", "line 4: rag_server", "line 5: sglang_patches.chunk_key",
        "line 11: rag_server.cli",
    ]
    assert upward_imports("picrag_core", source, "picrag_core.example") == [
        "line 3: rag_server.api.app", "line 4: rag_server", "line 5: sglang_patches.chunk_key",
        "line 8: cache_repair.pairs", "line 10: retrieval.embedder", "line 11: rag_server.cli",
    ]


# The engine package's folders, bottom to top: a module imports only folders ranked below its
# own (and its own folder); folders of one rank are independent. Modules at the top level
# (plugin, selfcheck) rank above every folder.
ENGINE_FOLDER_RANKS = {"cpu": 0, "store": 0, "kernel_fallback": 0, "guard": 1, "plan": 2, "steps": 3,
                       "attention": 4, "tree": 4}
TOP_RANK = max(ENGINE_FOLDER_RANKS.values()) + 1


def package_modules(package: str = "sglang_patches") -> dict[str, str]:
    """Every module of `package` (dotted name -> source), a package under its own name."""
    modules = {}
    for path in sorted((REPO / package).rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path.read_text()
    return modules


def engine_folder(module: str) -> str | None:
    """The folder of an engine module, None for one at the package's top level."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in ENGINE_FOLDER_RANKS) else None


def package_imports(modules: dict[str, str]) -> dict[str, set[str]]:
    """Which of `modules` each of them imports, `from package import module` counted as the
    module. (No module of picrag's imports relatively, so none needs its package resolved.)"""
    graph = {}
    for module, source in modules.items():
        names = [name for _, name in imported_modules(source, module)]
        names += [f"{node.module}.{alias.name}" for node in ast.walk(ast.parse(source))
                  if isinstance(node, ast.ImportFrom) and node.module for alias in node.names]
        found = {name for name in names if name in modules and name != module}
        graph[module] = found - {m.rsplit(".", 1)[0] for m in found}  # a package named only on the way to a module
    return graph


def upward_folder_imports(graph: dict[str, set[str]]) -> list[str]:
    offences = []
    for module, imported in sorted(graph.items()):
        own = engine_folder(module)
        rank = TOP_RANK if own is None else ENGINE_FOLDER_RANKS[own]
        for name in sorted(imported):
            folder = engine_folder(name)
            if folder != own and (folder is None or ENGINE_FOLDER_RANKS[folder] >= rank):
                offences.append(f"{module} imports {name}")
    return offences


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    found: list[list[str]] = []
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        for name in sorted(graph.get(module, ())):
            if name in path:
                found.append(path[path.index(name):] + [name])
            elif name not in done:
                visit(name, path + [name])
        done.add(module)

    for module in sorted(graph):
        if module not in done:
            visit(module, [module])
    return found


def test_the_engine_folders_import_one_way():
    modules = package_modules()
    assert {engine_folder(m) for m in modules} - {None} == set(ENGINE_FOLDER_RANKS), "a folder without a rank"
    assert upward_folder_imports(package_imports(modules)) == []


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_module_imports_itself_through_others(package):
    assert circles(package_imports(package_modules(package))) == []


def test_the_engine_checks_see_a_folder_importing_upward_and_a_circle():
    modules = {"sglang_patches.store.disk": "def late():\n    from sglang_patches.tree import chunk_cache",
               "sglang_patches.tree": "", "sglang_patches.tree.chunk_cache": "import sglang_patches.store.disk",
               "sglang_patches.store": "", "sglang_patches.plugin": "from sglang_patches.tree.chunk_cache import X"}
    graph = package_imports(modules)
    assert graph == {"sglang_patches.store.disk": {"sglang_patches.tree.chunk_cache"},
                     "sglang_patches.tree": set(), "sglang_patches.store": set(),
                     "sglang_patches.tree.chunk_cache": {"sglang_patches.store.disk"},
                     "sglang_patches.plugin": {"sglang_patches.tree.chunk_cache"}}
    assert upward_folder_imports(graph) == ["sglang_patches.store.disk imports sglang_patches.tree.chunk_cache"]
    assert [set(circle) for circle in circles(graph)] == [{"sglang_patches.store.disk", "sglang_patches.tree.chunk_cache"}]
