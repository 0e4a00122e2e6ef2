"""No import circle anywhere in megatron_dapo, module by module: import-linter's layers keep packages
apart, this keeps the files of one package apart too (function-level and TYPE_CHECKING imports count:
a circle hidden in a function is still a circle)."""

import ast
import graphlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "megatron_dapo"


def _modules(root: Path) -> dict[str, Path]:
    out = {}
    for path in (root / PACKAGE).rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imported(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules `module` imports: `from a.b import c` is a.b.c where that is a module, else a.b."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                here = here[: len(here) - node.level + 1]
                base = ".".join(here + ([node.module] if node.module else []))
            for alias in node.names:
                target = f"{base}.{alias.name}"
                found.add(target if target in modules else base)
    return {m for m in found if m in modules and m != module}


def import_graph(root: Path) -> dict[str, set[str]]:
    modules = _modules(root)
    return {m: _imported(m, p, modules) for m, p in modules.items()}


def test_no_module_imports_itself_back():
    graph = import_graph(ROOT)
    assert len(graph) > 100  # the whole package was read
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as e:
        pytest.fail(f"import circle: {' -> '.join(e.args[1])}")


def test_a_circle_through_a_function_level_import_is_found(tmp_path):
    pkg = tmp_path / PACKAGE / "room"
    pkg.mkdir(parents=True)
    (tmp_path / PACKAGE / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from megatron_dapo.room import b\n")
    (pkg / "b.py").write_text("def f():\n    from . import a\n")
    with pytest.raises(graphlib.CycleError):
        graphlib.TopologicalSorter(import_graph(tmp_path)).prepare()
