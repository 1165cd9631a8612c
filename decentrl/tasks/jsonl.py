"""Tasks whose prompts come from a local JSONL file: one object per line with the prompt fields.

`decentrl tasks generate` is not needed: small files ship in decentrl/tasks/data/, and
`python -m decentrl.tasks.generate` writes larger ones (same format, seeded).
"""

from __future__ import annotations

import json
from pathlib import Path

DATA_DIR = Path(__file__).parent / "data"


def read_jsonl(path: str, required: tuple[str, ...]) -> list[dict]:
    """Every line of `path` as a dict; a clear error names the line and the missing field."""
    file = Path(path) if Path(path).is_absolute() or Path(path).exists() else DATA_DIR / path
    if not file.is_file():
        raise ValueError(f"task prompts file {path!r} not found (looked in the current directory and {DATA_DIR})")
    rows = []
    for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{file}:{number}: not valid JSON ({exc})") from None
        missing = [name for name in required if name not in row]
        if missing:
            raise ValueError(f"{file}:{number}: missing field(s) {', '.join(missing)}")
        rows.append(row)
    if not rows:
        raise ValueError(f"{file}: no prompts")
    return rows
