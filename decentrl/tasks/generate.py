"""Write seeded prompt files for the built-in JSONL tasks.

    python -m decentrl.tasks.generate arithmetic out.jsonl --count 5000 --seed 0
    python -m decentrl.tasks.generate countdown out.jsonl --count 5000 --seed 0
"""

from __future__ import annotations

import argparse
import json
import random

from decentrl.tasks.arithmetic import evaluate


def arithmetic_row(rng: random.Random) -> dict:
    terms = [str(rng.randint(0, 99)) for _ in range(rng.randint(2, 3))]
    expression = terms[0] + "".join(rng.choice("+-*") + term for term in terms[1:])
    return {"question": expression, "answer": evaluate(expression)}


def countdown_row(rng: random.Random) -> dict:
    # The target is built from the numbers, so every prompt has a solution.
    numbers = [rng.randint(1, 25) for _ in range(4)]
    a, b, c = rng.sample(numbers, 3)
    target = rng.choice([a + b + c, a * b - c, (a + b) * c, a * b + c])
    return {"numbers": numbers, "target": target}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("task", choices=["arithmetic", "countdown"])
    parser.add_argument("out")
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    make = arithmetic_row if args.task == "arithmetic" else countdown_row
    with open(args.out, "w", encoding="utf-8") as file:
        for _ in range(args.count):
            file.write(json.dumps(make(rng)) + "\n")


if __name__ == "__main__":
    main()
