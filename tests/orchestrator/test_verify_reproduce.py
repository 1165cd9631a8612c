"""Deterministic runs make every honest sample recomputable (issue 17, docs/security.md): the
verifier re-draws each token of a checked sample from the sample's own seeded generator in the
same forward as the logprob check, and a token that is not its seed's draw is a strike
(`not_reproduced`). Real parts: a file:// store with a published tiny model, the real HF backend
generating as a deterministic worker does, RunState and the Verifier.

The attack shown is the one the logprob check cannot see: samples that are the policy's own,
with honest logprobs, but chosen rather than drawn from their seeds (here: drawn from other
seeds, as a worker keeping the best of several tries would)."""

from __future__ import annotations

import os
import uuid
from typing import Any

import pytest
from transformers import PreTrainedTokenizerBase

from decentrl.api.wire import Lease, Rollout
from decentrl.rl.determinism import sample_seed
from decentrl.store.checkpoints import CheckpointStore
from decentrl.tasks import build_task
from orchestrator.state import RunState
from orchestrator.verify import Verifier
from tests.orchestrator.test_orchestrator_verify import build_tiny, publish, verify_all
from workers.backends.hf import HFBackend

RUN_SEED = 11
HONEST, CHEAT = "honest/w0", "mallory/w0"


@pytest.fixture(scope="module")
def backend(tmp_path_factory: Any) -> tuple[CheckpointStore, HFBackend]:
    tmp = str(tmp_path_factory.mktemp("reproduce"))
    store = CheckpointStore(f"file://{tmp}/store")
    publish(store, tmp, 0, seed=0)
    worker = HFBackend(seed=0)
    worker.load(store.pull(0, os.path.join(tmp, "worker-cache")), 0)
    return store, worker


@pytest.fixture
def run(make_config: Any, tokenizer: PreTrainedTokenizerBase, backend: Any, tmp_path: Any) -> Any:
    def make(*, reproduce: bool = True) -> tuple[RunState, Verifier]:
        verification = {"enabled": True, "new_worker_checks": 100, "spot_check_fraction": 0.0, "max_strikes": 2}
        config = make_config(deterministic=True, seed=RUN_SEED, orchestrator={"verification": verification})
        state = RunState(config=config, task=build_task(config.task), tokenizer=tokenizer)
        state.announce(0)
        verifier = Verifier(
            config.orchestrator.verification, store=backend[0], cache_dir=str(tmp_path / "vcache"), build=build_tiny,
            run_seed=RUN_SEED if reproduce else None,
        )
        return state, verifier

    return make


def sampled(worker: HFBackend, state: RunState, lease: Lease, seed_offset: int = 0) -> list[Rollout]:
    """The group as a deterministic worker samples it (workers/worker.py `_generate_seeded`): sample
    j from the seed of (run seed, prompt, j, version) - or, with `seed_offset`, from another seed."""
    assert lease.policy_version is not None
    seeds = [sample_seed(RUN_SEED + seed_offset, lease.prompt_id, j, lease.policy_version) for j in range(lease.group_size)]
    completions = worker.generate([lease.prompt_token_ids] * lease.group_size, state.sampling, seeds=seeds)
    return [
        Rollout(
            rollout_id=uuid.uuid4().hex, run_name="unit", lease_id=lease.lease_id, prompt_id=lease.prompt_id,
            worker_id="w0", sample_index=j, policy_version=lease.policy_version, prompt_token_ids=lease.prompt_token_ids,
            completion_token_ids=c.token_ids, logprobs=c.logprobs, finish_reason=c.finish_reason, sampling=state.sampling,
        )
        for j, c in enumerate(completions)
    ]


@pytest.mark.kernels
def test_honest_seeded_samples_reproduce(run: Any, backend: Any) -> None:
    state, verifier = run()
    for lease in state.grant_leases(HONEST, 4):
        assert state.ingest(sampled(backend[1], state, lease), HONEST).accepted == lease.group_size
    assert verify_all(state, verifier) == {}
    assert verifier.rollouts_checked == 12 and verifier.draw_s > 0
    assert state.integrity.workers["honest"].strikes == 0 and len(state.ready) == 4


@pytest.mark.kernels
def test_chosen_samples_with_honest_logprobs_are_struck(run: Any, backend: Any) -> None:
    # Without the re-draw (as a run that is not deterministic checks) the chosen samples pass:
    # their logprobs are the policy's own.
    state, verifier = run(reproduce=False)
    lease = state.grant_leases(CHEAT, 1)[0]
    state.ingest(sampled(backend[1], state, lease, seed_offset=1), CHEAT)
    assert verify_all(state, verifier) == {}

    state, verifier = run()
    for lease in state.grant_leases(CHEAT, 2):
        assert state.ingest(sampled(backend[1], state, lease, seed_offset=1), CHEAT).accepted == lease.group_size
    failures = verify_all(state, verifier)
    # Every sample whose tokens differ from its seed's draws is struck (a short completion may
    # coincide with the true draw: the tiny model's distribution is peaked on a few tokens).
    assert failures and set(failures.values()) == {"not_reproduced"}
    assert len(failures) >= 4
    assert not state.ready and state.rejected["not_reproduced"] == len(failures)
    assert state.new_bans == ["mallory"]


@pytest.mark.kernels
def test_a_single_forged_token_is_enough(run: Any, backend: Any) -> None:
    """One token changed to another the policy could have drawn there, its logprob recomputed by
    the verifier itself (so the logprob check agrees): not the seed's draw, struck."""
    state, verifier = run()
    lease = state.grant_leases(CHEAT, 1)[0]
    honest = sampled(backend[1], state, lease)
    first = honest[0]
    ids = list(first.completion_token_ids)
    ids[0] = 5 if ids[0] != 5 else 6  # ordinary tokens (ids from 3 up: tests/orchestrator/test_orchestrator_verify.py)
    forged = first.model_copy(update={"completion_token_ids": ids})
    forged = forged.model_copy(update={"logprobs": verifier.recompute([forged], 0)[0].tolist()})
    judged = verifier.judge([forged])[0]
    assert judged.worst == 0.0 and not judged.reproduced
    assert state.ingest([forged, *honest[1:]], CHEAT).accepted == lease.group_size
    assert verify_all(state, verifier) == {forged.rollout_id: "not_reproduced"}
