"""The modules of ``jaxdp/training`` import each other without a cycle (function-local imports included).

An import cycle hides behind function-local imports until someone moves one to the top; a
graph over every ``import`` statement (``ast``, so nothing is executed) keeps the package a
tree that reads bottom-up: shared pieces, then the mechanisms, then the driver.
"""

import ast
import pathlib

PKG = pathlib.Path(__file__).resolve().parents[2] / "jaxdp" / "training"


def _graph() -> dict[str, set[str]]:
    """Module name -> the sibling modules it imports (any depth in the file)."""
    names = {p.stem for p in PKG.glob("*.py")}
    graph = {}
    for path in PKG.glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                if node.module:
                    deps.add(node.module.split(".")[0])
                else:  # from . import _x
                    deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith(
                    "jaxdp.training."):
                deps.add(node.module.split(".")[2])
        graph[path.stem] = {d for d in deps if d in names and d != path.stem}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a list of names (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state:
                found = visit(dep)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_cycle_in_training():
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle in jaxdp/training: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_cycles():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


MAX_LINES = 600  # issue 20's acceptance: a module a reader can hold in mind


def test_training_modules_are_at_most_600_lines():
    long = {p.name: n for p in PKG.glob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long
