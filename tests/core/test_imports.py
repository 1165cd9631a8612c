"""The import rules between the packages, read from the source (every import statement, at the
top of a module, inside a function or under TYPE_CHECKING):

- the core `decentrl/` imports no role (`orchestrator`, `workers`), except the command line in
  `decentrl/cli/`, which launches roles;
- `orchestrator` and `workers` never import each other: they meet over HTTP and the store;
- neither role imports trainer code (`decentrl.trainer`): the trainer is a third process, known
  to them through the orchestrator's API and the published checkpoints.

And `decentrl --help` loads no role at all: the command line imports them inside its commands.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("decentrl", "orchestrator", "workers")


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, module) for every import in the file; `from a import b` yields both `a` and `a.b`
    (b may be a submodule). Relative imports are resolved against the file's package."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{anchor}.{base}" if base else anchor
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def forbidden(importer: str) -> tuple[str, ...]:
    """The modules `importer` must not import."""
    if within(importer, "decentrl.cli"):
        return ()
    if within(importer, "decentrl"):
        return ("orchestrator", "workers")
    if within(importer, "orchestrator"):
        return ("workers", "decentrl.trainer")
    return ("orchestrator", "decentrl.trainer")  # workers


SOURCES = sorted(path for package in PACKAGES for path in (ROOT / package).rglob("*.py"))


def test_every_package_is_read() -> None:
    names = {module_name(path) for path in SOURCES}
    assert {"decentrl.store.weights", "decentrl.trainer.train", "orchestrator.verify", "workers.backends.hf"} <= names


@pytest.mark.parametrize("path", SOURCES, ids=lambda path: str(path.relative_to(ROOT)))
def test_imports_follow_the_package_rules(path: Path) -> None:
    importer = module_name(path)
    broken = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for line, module in imports(path)
        if any(within(module, rule) for rule in forbidden(importer))
    ]
    assert not broken, "\n".join(broken)


def test_the_rules_see_imports_inside_functions(tmp_path: Path) -> None:
    """The reader itself: a lazy import and a relative one are found as well as a top-level one."""
    source = tmp_path / "decentrl" / "core" / "thing.py"
    source.parent.mkdir(parents=True)
    source.write_text(
        "import json\n"
        "def f():\n"
        "    from workers.backends import hf\n"
        "    from ..trainer import train\n"
    )
    found = {module for _, module in imports(source, root=tmp_path)}
    assert {"json", "workers.backends", "workers.backends.hf", "decentrl.trainer", "decentrl.trainer.train"} <= found


def test_the_command_line_loads_no_role_until_a_command_runs() -> None:
    code = (
        "import sys, decentrl.cli.main\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('orchestrator', 'workers') or m.startswith('decentrl.trainer')))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert result.stdout.strip() == "[]"


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the modules of the three packages it imports (anywhere in the file), each import
    resolved to the longest known module name."""
    modules = {module_name(p, root): p for package in PACKAGES for p in (root / package).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = set()
        for _, module in imports(path, root):
            parts = module.split(".")
            known = next((".".join(parts[:k]) for k in range(len(parts), 0, -1) if ".".join(parts[:k]) in modules), None)
            if known is not None and known != name:
                found.add(known)
        graph[name] = found
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            child = next(edges, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_module_imports_itself_back() -> None:
    """No import circle among decentrl/, orchestrator/ and workers/, counting imports inside
    functions: a function-local import hides a circle from Python, not from the design."""
    assert circles(import_graph()) == []


def test_the_circle_finder_finds_a_circle_through_a_function_local_import(tmp_path: Path) -> None:
    (tmp_path / "decentrl").mkdir()
    (tmp_path / "decentrl" / "a.py").write_text("from decentrl import b\n")
    (tmp_path / "decentrl" / "b.py").write_text("def f():\n    from decentrl.c import x\n")
    (tmp_path / "decentrl" / "c.py").write_text("import decentrl.a\n")
    (tmp_path / "decentrl" / "d.py").write_text("import decentrl.a\n")
    assert circles(import_graph(tmp_path)) == [["decentrl.a", "decentrl.b", "decentrl.c"]]
