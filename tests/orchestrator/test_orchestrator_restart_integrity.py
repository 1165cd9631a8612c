"""Issue 8: strikes, bans and replay hashes survive a real orchestrator restart.

A real `python -m decentrl orchestrator` with [orchestrator.verification] on and a one-prompt
pool (every lease is the same prompt, so content can be replayed), driven over HTTP with the
real OrchestratorClient: an honest worker's group is kept, `mallory` - a DECENTRL_TOKENS token,
which no ban can revoke, so only the journaled ban keeps it out - earns two strikes and is
banned, `eve` earns one. Then SIGKILL, and the same command again. After the restart mallory
is still banned (403 on leases, "banned" on rollouts), eve still has her strike, and eve
replaying the honest group's content under a newer version is rejected as a replay: a
second strike, and her ban.
"""

from __future__ import annotations

import signal
import uuid
from pathlib import Path

import pytest

from decentrl.api.client import OrchestratorClient, OrchestratorError
from decentrl.api.wire import Lease, LeaseRequest, Rollout, RolloutBatch, SamplingParams
from decentrl.cli.launch import free_port
from orchestrator.auth import add_token
from tests.orchestrator.test_orchestrator_kill9 import publish, start
from tests.pipeline.test_pipeline import TINY_MODEL

pytestmark = pytest.mark.integration

CONFIG = f"""
run_name = "restart-integrity"
group_size = 2
trainer_ranks = 1
{TINY_MODEL}
[task]
num_prompts = 1
[orchestrator]
lease_timeout_s = 600.0
rate_limit_per_s = 0
[orchestrator.verification]
enabled = true
new_worker_checks = 0
spot_check_fraction = 0.0
max_strikes = 2
[trainer]
groups_per_step = 1
"""


def rollouts(lease: Lease, sampling: SamplingParams, version: int, worker_id: str = "w0", **fields: object) -> list[Rollout]:
    return [
        Rollout(
            rollout_id=uuid.uuid4().hex, run_name="restart-integrity", lease_id=lease.lease_id, prompt_id=lease.prompt_id,
            worker_id=worker_id, policy_version=version, prompt_token_ids=lease.prompt_token_ids,
            completion_token_ids=[4 + i, 5, 2], logprobs=[-0.5, -0.25, -0.125], finish_reason="stop", sampling=sampling,
            **fields,
        )
        for i in range(lease.group_size)
    ]


def test_bans_strikes_and_replay_hashes_survive_a_kill_and_restart(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text(CONFIG)
    tokens = str(tmp_path / "tokens.json")
    trainer_token = add_token(tokens, name="trainer", role="trainer")
    honest_token = add_token(tokens, name="honest", role="worker")
    eve_token = add_token(tokens, name="eve", role="worker")
    env = {"DECENTRL_TOKENS": "mallory:worker:mallory-secret-token-0123456789"}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    trainer, honest = OrchestratorClient(url, trainer_token), OrchestratorClient(url, honest_token)
    eve, mallory = OrchestratorClient(url, eve_token), OrchestratorClient(url, "mallory-secret-token-0123456789")

    publish(tmp_path, 0, 1)
    process = start(config, tmp_path, port, env)
    try:
        trainer.announce(0)
        answer = honest.lease(LeaseRequest(worker_id="w0", max_groups=1))
        kept = rollouts(answer.leases[0], answer.sampling, 0)
        assert honest.post_rollouts(RolloutBatch(rollouts=kept)).accepted == 2
        answer = mallory.lease(LeaseRequest(worker_id="w0", max_groups=1))
        for _ in range(2):  # claims a version not yet published: a strike each
            result = mallory.post_rollouts(RolloutBatch(rollouts=rollouts(answer.leases[0], answer.sampling, 7)[:1]))
            assert [r.reason for r in result.rejected] == ["future_version"]
        answer = eve.lease(LeaseRequest(worker_id="w0", max_groups=1))
        lying = rollouts(answer.leases[0], answer.sampling, 0)[:1]
        lying[0] = lying[0].model_copy(update={"completion_token_ids": [4, 5, 6]})  # "stop" without end-of-sequence
        assert [r.reason for r in eve.post_rollouts(RolloutBatch(rollouts=lying)).rejected] == ["bad_finish_reason"]
        workers = trainer.status().workers
        assert workers["mallory"]["banned"] and workers["eve"]["strikes"] == 1
        trainer.announce(1)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()

    process = start(config, tmp_path, port, env)
    try:
        status = trainer.status()
        assert status.recoveries == 1
        assert status.workers["mallory"]["banned"] and status.workers["mallory"]["strikes"] == 2
        assert status.workers["eve"]["strikes"] == 1 and not status.workers["eve"]["banned"]
        assert status.workers["honest"]["rollouts"] == 2
        with pytest.raises(OrchestratorError) as refused:
            mallory.lease(LeaseRequest(worker_id="w0", max_groups=1))
        assert refused.value.status == 403
        stray = rollouts(Lease(lease_id="x", prompt_id=0, prompt_token_ids=[1], group_size=2, deadline=0.0), kept[0].sampling, 1)
        assert [r.reason for r in mallory.post_rollouts(RolloutBatch(rollouts=stray[:1])).rejected] == ["banned"]
        # The honest group's content again, for a new lease of the same prompt, claimed as version 1's.
        answer = eve.lease(LeaseRequest(worker_id="w1", max_groups=1))
        lease = answer.leases[0]
        assert lease.prompt_token_ids == kept[0].prompt_token_ids
        replay = [
            r.model_copy(update={"rollout_id": uuid.uuid4().hex, "lease_id": lease.lease_id, "worker_id": "w1", "policy_version": 1})
            for r in kept
        ]
        assert {r.reason for r in eve.post_rollouts(RolloutBatch(rollouts=replay[:1])).rejected} == {"replay"}
        workers = trainer.status().workers
        assert workers["eve"]["strikes"] == 2 and workers["eve"]["banned"]
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
