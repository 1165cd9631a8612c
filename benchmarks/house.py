"""How livable the roles' code is, read from the source (nothing is run): issue 28's measures.

    python benchmarks/house.py

- `levels`: the depth of orchestrator/'s import graph. A module that imports no other module of
  orchestrator/ is on level 1; any other is one above the highest it imports (every import
  counts: at the top, inside a function, under TYPE_CHECKING).
- `circles`: import circles among decentrl/, orchestrator/ and workers/ (tests/core/test_imports.py
  keeps this at 0).
- `files`, `lines`, `code_lines`: orchestrator/ + workers/; `lines` as `wc -l` counts them,
  `code_lines` without blank lines, comments and docstrings.
- `imports_within`: for each module of orchestrator/, the modules of orchestrator/ it imports.
The last line printed is one JSON object.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.core.test_imports import circles, import_graph  # noqa: E402  (the one import-graph reader)


def levels(graph: dict[str, set[str]], package: str) -> dict[str, int]:
    inside = {name: {m for m in targets if m in graph and m.startswith(package + ".")} - {name}
              for name, targets in graph.items() if name.startswith(package + ".")}
    found: dict[str, int] = {}

    def level(name: str) -> int:
        if name not in found:
            found[name] = 1 + max((level(m) for m in inside[name]), default=0)
        return found[name]

    for name in inside:
        level(name)
    return found


def code_lines(source: str) -> int:
    lines = source.splitlines()
    skip = {i for i, line in enumerate(lines, 1) if not line.strip() or line.strip().startswith("#")}
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body:
            first = body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                skip.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return len(lines) - len(skip)


def main() -> None:
    graph = import_graph()
    depth = levels(graph, "orchestrator")
    sources = [path.read_text(encoding="utf-8") for folder in ("orchestrator", "workers")
               for path in sorted((ROOT / folder).rglob("*.py"))]
    within = {name: sorted(m for m in graph[name] if m.startswith("orchestrator.") and m != name and m in graph)
              for name in sorted(depth)}
    for name in sorted(depth, key=lambda n: (-depth[n], n)):
        print(f"level {depth[name]:2d}  {name}")
    print(json.dumps({
        "levels": max(depth.values()),
        "circles": len(circles(graph)),
        "files": len(sources),
        "lines": sum(len(source.splitlines()) for source in sources),
        "code_lines": sum(code_lines(source) for source in sources),
        "imports_within": within,
    }))


if __name__ == "__main__":
    main()
