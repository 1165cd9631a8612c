"""Cost of splitting completions into process-reward steps (decentrl/rl/steps.py `split_steps`).

Trains two small tokenizers here on reasoning-like text (byte-level BPE as Qwen and Llama 3 use,
and SentencePiece-style Metaspace), builds completions of 4, 16 and 32 "\\n\\n"-separated steps, and
times `split_steps` with the orchestrator's decoder (orchestrator/tokenizer.py `make_decoder`): the
median of `--repeats` calls after one warm-up. The orchestrator runs it once per sample of a
process-reward task. docs/rewards.md#steps holds the figures.
Last line: one JSON object, `split_ms_<tokenizer>_<steps>` (milliseconds per completion) and
`tokens_<tokenizer>_<steps>` (its length).
Usage: python benchmarks/process_steps.py [--repeats 50]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from decentrl.config import DelimiterStepsConfig
from decentrl.model.tokenizer import RustTokenizer
from decentrl.rl.steps import split_steps
from orchestrator.tokenizer import make_decoder

WORDS = "let x be the sum of two numbers then we add three and check the answer is five so".split()


def paragraph(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randrange(20, 60))) + "."


def tokenizer(kind: str, rng: random.Random) -> Tokenizer:
    corpus = ["\n\n".join(paragraph(rng) for _ in range(5)) for _ in range(200)]
    built = Tokenizer(models.BPE())
    if kind == "byte_level":
        built.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        built.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=2000, special_tokens=["</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    else:
        built.pre_tokenizer = pre_tokenizers.Metaspace()
        built.decoder = decoders.Metaspace()
        trainer = trainers.BpeTrainer(vocab_size=2000, special_tokens=["</s>"])
    built.train_from_iterator(corpus, trainer)
    return built


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    rng = random.Random(0)
    config = DelimiterStepsConfig(max_steps=64)
    result: dict[str, float] = {}
    for kind in ("byte_level", "metaspace"):
        built = tokenizer(kind, rng)
        decode = make_decoder(RustTokenizer(built, special_tokens=["</s>"], eos_token="</s>"))
        for steps in (4, 16, 32):
            ids = built.encode("\n\n".join(paragraph(rng) for _ in range(steps))).ids + [built.token_to_id("</s>")]
            assert len(split_steps(ids, None, decode=decode, config=config).ends) == steps
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                split_steps(ids, None, decode=decode, config=config)
                times.append(time.perf_counter() - start)
            result[f"split_ms_{kind}_{steps}"] = round(statistics.median(times) * 1e3, 3)
            result[f"tokens_{kind}_{steps}"] = len(ids)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
