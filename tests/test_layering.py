"""Imports run downward only: rag_server -> cache_repair -> retrieval, rag_server ->
sglang_patches, and every one of them -> picrag_core, which imports none of them. So retrieval
and training never import engine code, and the engine package holds only what runs inside SGLang.

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
