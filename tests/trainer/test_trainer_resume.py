"""The pieces of trainer resume that need no processes: the resume plan, the batch journal, the
metrics file rewrite, a one-rank DCP round trip, and the trainer config's checks."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from decentrl.api.wire import TrainBatch, TrainSample
from decentrl.config import ConfigError, TinyModelConfig
from decentrl.model.build import build_model
from decentrl.trainer.checkpoint import BatchJournal, Progress, ResumePlan, TrainerCheckpoints, plan_resume
from decentrl.trainer.distributed import shard_model
from decentrl.trainer.metrics import MetricsLog


def test_resume_plan_of_a_fresh_run() -> None:
    assert plan_resume(None, [], [0]) == ResumePlan(checkpoint=0, replay_through=0, published=0)


def test_resume_plan_replays_the_journal_after_the_checkpoint_without_republishing() -> None:
    # Checkpoint at 6; batches 7..9 journaled (5, 6 are left over from before the checkpoint);
    # the store got versions up to 8 before the crash.
    plan = plan_resume(6, [5, 6, 7, 8, 9], [0, 4, 5, 6, 7, 8])
    assert plan == ResumePlan(checkpoint=6, replay_through=9, published=8)


def test_resume_plan_before_the_first_checkpoint_starts_from_version_0() -> None:
    assert plan_resume(None, [1, 2, 3], [0, 1, 2]) == ResumePlan(checkpoint=0, replay_through=3, published=2)


def test_resume_plan_stops_the_replay_at_a_gap_in_the_journal() -> None:
    assert plan_resume(3, [4, 6], [0, 3, 4]).replay_through == 4


def test_resume_plan_refuses_a_store_ahead_of_the_trainer_state() -> None:
    with pytest.raises(RuntimeError, match="the store belongs to another run"):
        plan_resume(None, [], [0, 1, 2, 3])
    with pytest.raises(RuntimeError, match="restore this run's trainer/ directory"):
        plan_resume(2, [3], [0, 1, 2, 3, 4])


def batch(version: int) -> TrainBatch:
    sample = TrainSample(prompt_token_ids=[1, 4], completion_token_ids=[5, 2], logprobs=[-0.25, -1.5],
                         advantage=0.5, reward=1.0, policy_version=version, group_id="g")
    return TrainBatch(trainer_version=version, samples=[sample], staleness_histogram={"0": 1}, rollouts_accepted=3, stale_dropped=1)


def test_replay_difference_of_a_tied_head_model_compares_what_the_store_holds(tmp_path: Path) -> None:
    """SmolLM2's head is its embeddings: the gathered state holds lm_head.weight, the published
    version does not (write_hf_dir writes it once, under the embeddings' name). Found by issue 46's
    F7: the restarted trainer stopped with KeyError: 'lm_head.weight' at its first replayed version."""
    from transformers import LlamaConfig

    from decentrl.store.checkpoints import CheckpointStore
    from decentrl.store.weights import write_hf_dir
    from decentrl.trainer.train import replay_difference

    config = LlamaConfig(vocab_size=16, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=16, tie_word_embeddings=True)
    embed = torch.randn(16, 8)
    state = {"model.embed_tokens.weight": embed, "lm_head.weight": embed, "model.norm.weight": torch.ones(8)}
    (tmp_path / "v").mkdir()
    write_hf_dir(str(tmp_path / "v"), state, config, extras_from=str(tmp_path / "v"), dtype=torch.bfloat16)
    store = CheckpointStore(str(tmp_path / "store"))
    store.publish(1, str(tmp_path / "v"))
    assert replay_difference(state, store, 1, str(tmp_path / "cache"), lora=False) == 0.0
    moved = {**state, "model.norm.weight": torch.full((8,), 1.5)}
    assert replay_difference(moved, store, 1, str(tmp_path / "cache"), lora=False) == 0.5


def test_batch_journal_round_trip_and_prune(tmp_path: Path) -> None:
    journal = BatchJournal(str(tmp_path / "batches"))
    for step in (1, 2, 3):
        journal.write(step, batch(step - 1))
    assert journal.steps() == [1, 2, 3]
    assert journal.read(2) == batch(1)
    journal.prune(2)
    assert journal.steps() == [3]
    assert sorted(os.listdir(tmp_path / "batches")) == ["step_000003.json"]  # no temporary files left


def test_metrics_log_drops_the_records_after_the_checkpoint_and_a_cut_line(tmp_path: Path) -> None:
    path = str(tmp_path / "metrics.jsonl")
    with open(path, "w") as file:
        file.writelines(json.dumps({"step": step, "loss": step / 10}) + "\n" for step in range(1, 6))
        file.write('{"step": 6, "lo')  # the write a kill -9 cut short
    log = MetricsLog(path, keep_through=3)
    log.write({"step": 4, "loss": 0.0, "replayed": True})
    log.close()
    steps = [json.loads(line)["step"] for line in open(path)]
    assert steps == [1, 2, 3, 4]


@pytest.fixture
def one_rank_group() -> Any:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(20000 + os.getpid() % 20000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_dcp_checkpoint_round_trip_restores_model_optimizer_scheduler_progress_rng(tmp_path: Path, one_rank_group: Any) -> None:
    def make(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
        model = shard_model(build_model(TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, seed=seed)))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda done: min(1.0, (done + 1) / 4))

    model, optimizer, scheduler = make(0)
    for _ in range(2):
        model(input_ids=torch.tensor([[1, 5, 7, 3]])).logits.square().mean().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    checkpoints = TrainerCheckpoints(str(tmp_path), keep=2)
    torch.manual_seed(123)
    committed = []
    checkpoints.save(
        model, optimizer, scheduler, Progress(step=2, busy_s=1.5, wall_s=3.0), before_commit=lambda: committed.append(checkpoints.latest())
    )
    expected_random = torch.rand(3)
    assert committed == [None], "before_commit runs before the checkpoint becomes visible"
    assert checkpoints.latest() == 2

    other, other_optimizer, other_scheduler = make(1)
    torch.manual_seed(999)
    progress = checkpoints.load(2, other, other_optimizer, other_scheduler)

    assert progress == Progress(step=2, busy_s=1.5, wall_s=3.0)
    assert torch.equal(torch.rand(3), expected_random), "the RNG continues where the checkpoint left it"
    assert other_scheduler.last_epoch == scheduler.last_epoch == 2
    assert other_optimizer.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
    for (name, a), (_, b) in zip(model.named_parameters(), other.named_parameters()):
        assert torch.equal(a.full_tensor(), b.full_tensor()), name
    for key, state in optimizer.state_dict()["state"].items():
        restored = other_optimizer.state_dict()["state"][key]
        assert torch.equal(state["exp_avg"].full_tensor(), restored["exp_avg"].full_tensor())
        assert torch.equal(state["step"], restored["step"])

    for step in (3, 4):
        checkpoints.save(model, optimizer, scheduler, Progress(step=step))
    assert sorted(os.listdir(tmp_path)) == ["step_000003", "step_000004"], "only checkpoint_keep are kept"


@pytest.mark.parametrize(
    "trainer, message",
    [
        ({"lr_warmup_steps": 5, "steps": 5}, "trainer.lr_warmup_steps (5) must be smaller than trainer.steps (5)"),
        ({"loss": {"type": "ppo"}}, "trainer.loss"),
        ({"off_policy": {"type": "icepop", "low": 1.5}}, "trainer.off_policy.low"),
        ({"off_policy": {"type": "tis", "cap": 0.5}}, "trainer.off_policy.cap"),
        ({"loss": {"type": "token", "eps_low": 0}}, "trainer.loss.eps_low"),
        ({"micro_batch_tokens": 1}, "trainer.micro_batch_tokens"),
        ({"mixed_precision": "fp16"}, "trainer.mixed_precision"),
        ({"checkpoint_every": 0}, "trainer.checkpoint_every"),
        ({"is_cap": 2.0}, "trainer.is_cap"),  # replaced by off_policy = {type = "tis", cap = ...}
    ],
)
def test_trainer_config_errors_name_the_field(make_config: Any, trainer: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as error:
        make_config(trainer={"steps": 10, **trainer})
    assert message in str(error.value)


def test_trainer_config_unions_pick_by_type(make_config: Any) -> None:
    config = make_config(trainer={"loss": {"type": "dr_grpo", "eps_high": 0.3}, "off_policy": {"type": "seq_mask", "low": 0.9}})
    assert config.trainer.loss.type == "dr_grpo" and config.trainer.loss.eps_high == 0.3
    assert config.trainer.off_policy.type == "seq_mask" and config.trainer.off_policy.low == 0.9
    assert make_config().trainer.off_policy.type == "tis"
