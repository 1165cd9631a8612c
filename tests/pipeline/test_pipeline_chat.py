"""A chat model end to end: `decentrl model init` trains a byte-level BPE tokenizer with a chat
template on a reasoning-gym task's text and writes a tiny model; `decentrl run` trains it as
`model.type = "pretrained"` (orchestrator, two workers, two-rank FSDP2 trainer over loopback);
the published version loads with plain transformers, chat template included; `decentrl eval`
scores it on reseeded prompts with pass@k."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from decentrl.store.checkpoints import CheckpointStore

pytestmark = pytest.mark.integration
pytest.importorskip("reasoning_gym", reason='needs the tasks extra: pip install -e ".[tasks]"')

STEPS = 3


def config_text(model_dir: Path) -> str:
    return f"""
run_name = "chat"
max_staleness = 1
group_size = 4
num_workers = 2
trainer_ranks = 2
[model]
type = "pretrained"
path = "{model_dir}"
[task]
type = "reasoning_gym"
datasets = [{{ name = "spell_backward", options = {{ min_word_len = 3, max_word_len = 4 }} }}]
size = 400
[prompt]
system = "Spell it."
[sampling]
max_tokens = 6
[orchestrator]
port = 0
[worker]
groups_per_request = 4
[trainer]
steps = {STEPS}
groups_per_step = 8
lr = 3e-3
"""


def decentrl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "decentrl", *args], capture_output=True, text=True, timeout=600)


def test_chat_model_trains_publishes_and_evaluates(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    config = tmp_path / "chat.toml"
    config.write_text(config_text(model_dir))
    made = decentrl("model", "init", str(config), "--out", str(model_dir), "--vocab-size", "280",
                    "--hidden-size", "32", "--num-layers", "1", "--num-heads", "2", "--intermediate-size", "64")
    assert made.returncode == 0, made.stderr

    run_dir = tmp_path / "run"
    result = decentrl("run", str(config), "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stdout + result.stderr
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["policy_version"] for m in metrics] == list(range(1, STEPS + 1))

    store = CheckpointStore(str(run_dir / "checkpoints"))
    assert store.latest() == STEPS and all(store.verify(v) == [] for v in store.versions())
    last = store.pull(STEPS, str(tmp_path / "pulled"))
    AutoModelForCausalLM.from_pretrained(last)
    tokenizer = AutoTokenizer.from_pretrained(last)
    assert tokenizer.chat_template == AutoTokenizer.from_pretrained(model_dir).chat_template
    assert tokenizer.eos_token == "<|im_end|>"

    evaluated = decentrl("eval", str(config), "--run-dir", str(run_dir), "--prompts", "8", "--samples", "2",
                         "--cache-dir", str(tmp_path / "cache"))
    assert evaluated.returncode == 0, evaluated.stderr
    scores = json.loads(evaluated.stdout.strip().splitlines()[-1])
    assert scores["version"] == STEPS and scores["prompts"] == 8
    assert set(scores["pass_at_k"]) == {"pass@1", "pass@2"}
    assert 0.0 <= scores["reward_mean"] <= 1.0
