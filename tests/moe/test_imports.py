"""The rocmoe.moe modules import each other in one direction only (DESIGN.md: no cycles)."""

import ast
import pathlib

MOE = pathlib.Path(__file__).resolve().parents[2] / "rocmoe" / "moe"


def _moe_imports(path: pathlib.Path) -> set[str]:
    """Sibling modules `path` imports anywhere (module level or inside functions)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:  # from .x import y
                found.add(node.module.split(".")[0])
            else:            # from . import x, y
                found.update(alias.name for alias in node.names)
    return found & {p.stem for p in MOE.glob("*.py")}


def test_moe_modules_import_each_other_without_cycles():
    graph = {p.stem: _moe_imports(p) for p in MOE.glob("*.py") if p.stem != "__init__"}
    state: dict[str, str] = {}

    def visit(name, path):
        if state.get(name) == "done":
            return
        assert state.get(name) != "open", "import cycle: " + " -> ".join(path + [name])
        state[name] = "open"
        for dep in sorted(graph.get(name, ())):
            visit(dep, path + [name])
        state[name] = "done"

    for name in sorted(graph):
        visit(name, [])
