"""The layout a newcomer can read: dependencies point one way, private modules stay private.

- nothing outside ``jaxdp/accounting`` (in the library and the examples) imports a private
  module of it (benchmarks may, to run the same computation in a peer's form);
- ``jaxdp.accounting`` imports nothing from training, models, data, audit or the command line;
- ``jaxdp.audit`` may import accounting and training (public names); nothing below it imports it;
- nothing in the library imports the command line;
- examples use only public names (no ``_private`` module or name of jaxdp).
"""

import ast
import pathlib

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
