"""Write the one-digit arithmetic prompts of configs/smollm2.toml: train.jsonl and heldout.jsonl.

Facts: a + b and a * b for a, b in 0-9, and a - b for a >= b (255 facts, answers 0-81), each asked
in five phrasings. A seeded quarter of the facts (64) is held out whole, in every phrasing, so
`decentrl eval` scores facts the run never trained on, not new wordings of trained ones.
Deterministic: running it again writes the same files.
    python configs/smollm2/make_data.py
"""

import json
import random
from pathlib import Path

PHRASINGS = (
    "What is {a} {op} {b}?",
    "Calculate {a} {op} {b}.",
    "{a} {op} {b} = ?",
    "Compute {a} {op} {b}. Give only the result.",
    "What does {a} {op} {b} equal?",
)
HELD_OUT_FACTS = 64
SEED = 0


def facts() -> list[tuple[int, str, int, int]]:
    """(a, op, b, answer) for every fact, in a fixed order."""
    out = []
    for a in range(10):
        for b in range(10):
            out.append((a, "+", b, a + b))
            out.append((a, "*", b, a * b))
            if a >= b:
                out.append((a, "-", b, a - b))
    return out


def rows(chosen: list[tuple[int, str, int, int]]) -> list[dict]:
    return [
        {"question": phrasing.format(a=a, op=op, b=b), "answer": answer}
        for a, op, b, answer in chosen
        for phrasing in PHRASINGS
    ]


def write(directory: Path) -> None:
    """train.jsonl and heldout.jsonl in `directory` (tests/core/test_config_smollm2.py compares them)."""
    everything = facts()
    held = set(random.Random(SEED).sample(range(len(everything)), HELD_OUT_FACTS))
    for name, part in (("train", [f for i, f in enumerate(everything) if i not in held]),
                       ("heldout", [f for i, f in enumerate(everything) if i in held])):
        (directory / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows(part)))


if __name__ == "__main__":
    write(Path(__file__).parent)
