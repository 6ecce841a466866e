"""The package layout holds (docs/design.md, "Layout"): imports run one way through the layers, no module imports
itself back through another, nothing loads a module by name, and nothing outside the engine touches its privates."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "jaxspec"

# lower layers never import higher ones; a module may import its own layer and below
LAYERS = {
    "jaxspec.models": 0,
    "jaxspec.types": 1, "jaxspec.menu": 1, "jaxspec.mesh": 1, "jaxspec.dtypes": 1, "jaxspec.resources": 1,
    "jaxspec.config_file": 1,
    "jaxspec.speculation": 2, "jaxspec.policy": 2,
    "jaxspec.engine": 3,
    "jaxspec.scheduling": 4,
    "jaxspec.training": 5,
    "jaxspec.serving": 6,
    "jaxspec.bench": 7,
    "jaxspec.cli": 8,
}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> int:
    for prefix in sorted(LAYERS, key=len, reverse=True):
        if module == prefix or module.startswith(prefix + "."):
            return LAYERS[prefix]
    raise AssertionError(f"{module} belongs to no layer: add it to LAYERS (and to docs/design.md, 'Layout')")


def sources() -> dict[str, ast.Module]:
    return {module_name(p): ast.parse(p.read_text(), str(p)) for p in sorted(PACKAGE.rglob("*.py"))
            if "_pb2" not in p.name}


def imports(tree: ast.Module, modules: set[str]) -> set[str]:
    """The jaxspec modules a module imports anywhere in it (function-level imports included)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("jaxspec")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jaxspec"):
            for alias in node.names:  # `from jaxspec.x import y`: y is a module or a name in jaxspec.x
                child = f"{node.module}.{alias.name}"
                found.add(child if child in modules else node.module)
    return found


MODULES = sources()
GRAPH = {name: imports(tree, set(MODULES)) & set(MODULES) for name, tree in MODULES.items()}


def test_every_module_has_a_layer():
    for name in MODULES:
        if name != "jaxspec":
            layer(name)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != "jaxspec"))
def test_imports_run_from_higher_layers_to_lower(module):
    upward = sorted(m for m in GRAPH[module] if m != "jaxspec" and layer(m) > layer(module))
    assert not upward, f"{module} (layer {layer(module)}) imports higher layers: {upward}"


def test_no_import_cycle():
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(GRAPH[module]):
            if target == module or target == "jaxspec":
                continue
            if state.get(target) == 1:
                cycle = path[path.index(target):] + [target]
                raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
            if target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [module])


def test_no_module_is_loaded_by_name():
    for name, tree in MODULES.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "import_module":
                raise AssertionError(f"{name} loads a module by name (importlib.import_module): import it")


def engine_privates() -> set[str]:
    """The private attributes the engine class sets on itself (self._x = ...) and its private methods."""
    tree = ast.parse((PACKAGE / "engine" / "engine.py").read_text())
    engine = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Engine")
    methods = {node.name for node in engine.body if isinstance(node, ast.FunctionDef)
               and node.name.startswith("_") and not node.name.endswith("__")}
    return methods | {node.attr for node in ast.walk(engine) if isinstance(node, ast.Attribute)
                      and node.attr.startswith("_") and isinstance(node.value, ast.Name) and node.value.id == "self"
                      and isinstance(node.ctx, ast.Store)}


def test_nothing_outside_the_engine_touches_its_private_attributes():
    privates = engine_privates()
    assert {"_params", "_proposer_params", "_lower", "_read"} <= privates  # the scan sees what it guards
    files = [p for p in (*PACKAGE.rglob("*.py"), *(REPO / "benchmarks").rglob("*.py"), *(REPO / "tests").rglob("*.py"))
             if p != PACKAGE / "engine" / "engine.py" and p != Path(__file__).resolve()]
    offenders = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr in privates
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno} .{node.attr}")
    assert not offenders, "the engine's private attributes touched from outside:\n" + "\n".join(offenders)
