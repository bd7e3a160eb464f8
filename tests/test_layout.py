"""The layout a newcomer can read: dependencies point one way, private modules stay private.

- nothing outside ``jaxdp/accounting`` (in the library and the examples) imports a private
  module of it (benchmarks may, to run the same computation in a peer's form);
- ``jaxdp.accounting`` imports nothing from training, models, data, audit or the command line;
- ``jaxdp.audit`` may import accounting and training (public names); nothing below it imports it;
- nothing in the library imports the command line;
- no import cycle inside ``jaxdp/accounting`` (module- or function-level); a function-level
  import there says why in a comment;
- examples use only public names (no ``_private`` module or name of jaxdp).
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PKG = ROOT / "jaxdp"


def _imports(path: pathlib.Path):
    """``(module, names)`` for every import, relative ones resolved to absolute names."""
    tree = ast.parse(path.read_text(), filename=str(path))
    rel = path.relative_to(ROOT).with_suffix("")
    package = list(rel.parts[:-1]) if rel.name != "__init__" else list(rel.parts[:-1])
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, []
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            yield mod, [a.name for a in node.names]


def _private(parts) -> bool:
    return any(p.startswith("_") and not p.startswith("__") for p in parts)


def test_accounting_private_modules_are_private():
    bad = []
    for path in list(PKG.rglob("*.py")) + list((ROOT / "examples").glob("*.py")):
        if (PKG / "accounting") in path.parents:
            continue
        for mod, names in _imports(path):
            parts = mod.split(".")
            if parts[:2] == ["jaxdp", "accounting"] and (_private(parts[2:]) or any(_private([n]) for n in names)):
                bad.append(f"{path.relative_to(ROOT)}: {mod} {names}")
    assert not bad, "\n".join(bad)


def test_dependencies_point_one_way():
    bad = []
    for path in PKG.rglob("*.py"):
        inside = path.relative_to(PKG).parts
        for mod, _ in _imports(path):
            parts = mod.split(".")
            if parts[0] != "jaxdp" or len(parts) < 2:
                continue
            if inside[0] == "accounting" and parts[1] in ("training", "models", "data", "cli", "audit"):
                bad.append(f"{path.relative_to(ROOT)} imports {mod}")
            if inside[0] in ("training", "models", "data") and parts[1] == "audit":  # audit sits above training
                bad.append(f"{path.relative_to(ROOT)} imports {mod}")
            if inside[0] != "cli" and parts[1] == "cli" and path.name != "__main__.py":
                bad.append(f"{path.relative_to(ROOT)} imports the command line ({mod})")
    assert not bad, "\n".join(bad)


def _accounting_import_graph():
    """``{module: {(imported module, line, function-level)}}`` inside ``jaxdp/accounting``."""
    folder = PKG / "accounting"
    names = {p.stem for p in folder.glob("*.py")}
    graph = {}
    for path in sorted(folder.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        nested = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                  for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
        edges = set()
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if isinstance(node, ast.Import):
                targets = [a.name.split(".") for a in node.names]
            elif node.level == 1:  # from . import _x / from ._x import y
                targets = ([["jaxdp", "accounting", node.module.split(".")[0]]] if node.module else
                           [["jaxdp", "accounting", a.name] for a in node.names])
            elif node.level == 0:
                mod = (node.module or "").split(".")
                targets = [mod + [a.name] if len(mod) == 2 else mod for a in node.names]
            else:
                continue  # from .. import: outside the folder
            for t in targets:
                if t[:2] != ["jaxdp", "accounting"]:
                    continue
                target = t[2] if len(t) > 2 and t[2] in names else "__init__"
                edges.add((target, node.lineno, id(node) in nested))
        graph[path.stem] = edges
    return graph


def test_accounting_has_no_import_cycle():
    """Module-level and function-level imports alike: a lazy import is still a dependency."""
    graph = {m: {t for t, _, _ in e} for m, e in _accounting_import_graph().items()}
    state, cycles = {}, []

    def visit(m, stack):
        state[m] = "open"
        for t in sorted(graph.get(m, ())):
            if state.get(t) == "open":
                cycles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t, stack + [t])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles in jaxdp/accounting:\n" + "\n".join(cycles)


@pytest.mark.parametrize("folder", ["accounting", "training"])
def test_function_level_imports_say_why(folder):
    """A function-level import is for an optional dependency or deliberate lazy loading, with a comment."""
    bad = []
    for path in sorted((PKG / folder).glob("*.py")):
        lines = path.read_text().splitlines()
        tree = ast.parse("\n".join(lines), filename=str(path))
        for f in ast.walk(tree):
            if not isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(f):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    here, above = lines[node.lineno - 1], lines[node.lineno - 2]
                    if "#" not in here and not above.strip().startswith("#"):
                        bad.append(f"{path.name}:{node.lineno}: {here.strip()}")
    assert not bad, "\n".join(bad)


def test_examples_use_public_names_only():
    bad = []
    for path in (ROOT / "examples").glob("*.py"):
        for mod, names in _imports(path):
            parts = mod.split(".")
            if parts[0] == "jaxdp" and (_private(parts[1:]) or any(_private([n]) for n in names)):
                bad.append(f"{path.name}: {mod} {names}")
    assert not bad, "\n".join(bad)


def test_no_pytree_registered_with_jax_register_dataclass():
    """jaxdp/_pytree.register_dataclass only: under JAX's (0.10.2) the tree structures of two classes
    with the same field count compare equal, and jit ran Laplace's program on a Gaussian event."""
    bad = []
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "register_dataclass" and \
                    isinstance(node.value, ast.Attribute) and node.value.attr == "tree_util":
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
            if isinstance(node, ast.ImportFrom) and node.module == "jax.tree_util" and \
                    any(a.name == "register_dataclass" for a in node.names):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not bad, bad
