"""Untrusted workers (issue 8): RunState with orchestrator.verification on, a real Verifier over a
real file:// store of published tiny models, honest rollouts from the real HF backend, and one
adversary per attack. Each attack must be caught; honest rollouts must pass.

BASE_CONFIG (conftest): group_size 3, groups_per_step 2, max_tokens 6.
"""

from __future__ import annotations

import asyncio
import math
import os
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from decentrl.api.wire import Lease, Rollout, RolloutBatch, SamplingParams
from decentrl.config import LoRAConfig, TinyModelConfig
from decentrl.model.build import build_model, build_tiny_tokenizer
from decentrl.store.checkpoints import CheckpointStore
from decentrl.store.weights import write_hf_dir
from decentrl.tasks import build_task
from decentrl.trainer.lora import add_adapters, is_adapter_weight, write_adapter_dir
from orchestrator.auth import TokenRegistry
from orchestrator.state import RunState
from orchestrator.verify import Verifier
from workers.backends.hf import HFBackend

TINY = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64}  # BASE_CONFIG's model
HONEST, CHEAT = "honest/w0", "mallory/w0"


def build_tiny() -> torch.nn.Module:
    """A model of the run's architecture for the verifier to copy versions into (its weights never used)."""
    return build_model(TinyModelConfig(**TINY, seed=7))


def publish(store: CheckpointStore, tmp: str, version: int, seed: int) -> str:
    model = build_model(TinyModelConfig(**TINY, seed=seed))
    directory = os.path.join(tmp, f"publish-{version}-{seed}")
    os.makedirs(directory)
    build_tiny_tokenizer().save_pretrained(directory)
    model.generation_config.save_pretrained(directory)
    write_hf_dir(directory, model.state_dict(), model.config, extras_from=directory)
    if version >= 0:
        store.publish(version, directory, parent=version - 1 if version else None)
    return directory


def publish_adapter(store: CheckpointStore, tmp: str, version: int, base_version: int) -> None:
    """A LoRA adapter version (rank 2, random adapter weights) on `base_version`."""
    lora = LoRAConfig(rank=2, alpha=4.0)
    adapted = add_adapters(build_model(TinyModelConfig(**TINY, seed=0)), lora)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in adapted.named_parameters():
            if is_adapter_weight(name):
                parameter.normal_(std=0.3, generator=generator)
    directory = os.path.join(tmp, f"adapter-{version}")
    write_adapter_dir(directory, adapted.state_dict(), lora)
    store.publish(version, directory, parent=base_version, base_version=base_version)


@pytest.fixture(scope="module")
def world(tmp_path_factory: Any) -> dict[str, Any]:
    """A store holding v0 (seed 0) and v1 (seed 2), and backends for v0 and a foreign model (seed 1)."""
    tmp = str(tmp_path_factory.mktemp("verify"))
    store = CheckpointStore(f"file://{tmp}/store")
    publish(store, tmp, 0, seed=0)
    publish(store, tmp, 1, seed=2)
    honest = HFBackend(seed=0)
    honest.load(store.pull(0, os.path.join(tmp, "worker-cache")), 0)
    foreign = HFBackend(seed=1)
    foreign.load(publish(store, tmp, -1, seed=1), 0)
    return {"tmp": tmp, "store": store, "honest": honest, "foreign": foreign}


@pytest.fixture
def setup(make_config: Any, tokenizer: PreTrainedTokenizerBase, world: dict[str, Any], tmp_path: Any) -> Any:
    def make(**verification: Any) -> tuple[RunState, Verifier]:
        options = {"enabled": True, "new_worker_checks": 6, "spot_check_fraction": 0.0, "max_strikes": 3}
        options.update(verification)
        config = make_config(orchestrator={"verification": options})
        state = RunState(config=config, task=build_task(config.task), tokenizer=tokenizer)
        state.announce(0)
        verifier = Verifier(
            config.orchestrator.verification, store=world["store"], cache_dir=str(tmp_path / "vcache"), build=build_tiny,
        )
        return state, verifier

    return make


def generated(backend: HFBackend, lease: Lease, sampling: SamplingParams, holder: str = HONEST, **fields: Any) -> list[Rollout]:
    completions = backend.generate([lease.prompt_token_ids] * lease.group_size, sampling)
    return [
        Rollout(
            rollout_id=uuid.uuid4().hex, run_name="unit", lease_id=lease.lease_id, prompt_id=lease.prompt_id,
            worker_id=holder.split("/")[1], policy_version=0, prompt_token_ids=lease.prompt_token_ids,
            completion_token_ids=c.token_ids, logprobs=c.logprobs, finish_reason=c.finish_reason, sampling=sampling,
            sampling_mask=c.sampling_mask, **fields,
        )
        for c in completions
    ]


def verify_all(state: RunState, verifier: Verifier) -> dict[str, str]:
    """Run the verification loop's work synchronously; returns every failure."""
    failures: dict[str, str] = {}
    verdicts: dict[str, dict[str, str]] = {}
    while state.verify_queue:
        job = state.verify_queue.popleft()
        verdicts[job.lease_id] = verifier.check(job.rollouts)
        failures.update(verdicts[job.lease_id])
    state.verification_done(verdicts)  # as the app's loop hands over the verdicts of one forward
    return failures


@pytest.mark.kernels
def test_honest_rollouts_pass_within_the_calibrated_tolerance(setup: Any, world: dict[str, Any]) -> None:
    """Honest fp32 CPU rollouts, plain and truncated sampling: the recomputed logprobs agree far
    inside the default tolerance (docs/security.md records the calibration)."""
    state, verifier = setup(new_worker_checks=1000)
    for sampling in (state.sampling, state.sampling.model_copy(update={"top_k": 5, "temperature": 0.7})):
        state.sampling = sampling
        for lease in state.grant_leases(HONEST, 2):
            assert state.ingest(generated(world["honest"], lease, sampling), HONEST).accepted == lease.group_size
    assert len(state.verify_queue) == 4
    assert verify_all(state, verifier) == {}
    assert len(state.ready) == 4 and verifier.rollouts_checked == 12
    assert 0 <= verifier.largest_passing_diff < verifier.config.tolerance / 10
    assert state.integrity.workers["honest"].strikes == 0


def test_forged_rewards_are_ignored_and_flagged(setup: Any, world: dict[str, Any]) -> None:
    state, verifier = setup(new_worker_checks=0)
    lease = state.grant_leases(CHEAT, 1)[0]
    rollouts = generated(world["honest"], lease, state.sampling, CHEAT, claimed_reward=1.0)
    truth = [state.task.reward(state.task.prompt(lease.prompt_id), t) for t in state._decode([r.completion_token_ids for r in rollouts])]
    assert state.ingest(rollouts, CHEAT).accepted == 3
    assert [reward for _, reward in state.ready[0].samples] == truth  # the claim is never used
    record = state.integrity.workers["mallory"]
    assert record.reward_mismatches == sum(1 for t in truth if t != 1.0) > 0
    assert state.status().workers["mallory"]["reward_mismatches"] == record.reward_mismatches
    # Flagged: every later rollout of this token is checked, though new_worker_checks is 0.
    lease = state.grant_leases(CHEAT, 1)[0]
    state.ingest(generated(world["honest"], lease, state.sampling, CHEAT), CHEAT)
    assert len(state.verify_queue) == 1 and len(state.verify_queue[0].rollouts) == 3


@pytest.mark.parametrize("attack", ["foreign_model", "random_tokens_uniform_logprobs", "wrong_version_claim"])
def test_forged_logprobs_are_rejected_and_the_token_banned(setup: Any, world: dict[str, Any], attack: str) -> None:
    state, verifier = setup()
    state.announce(1)
    lease = state.grant_leases(CHEAT, 1)[0]
    if attack == "foreign_model":  # a differently seeded model's honest samples, claimed as v0's
        rollouts = generated(world["foreign"], lease, state.sampling, CHEAT)
    elif attack == "wrong_version_claim":  # v0's samples claimed as fresher v1's
        rollouts = [r.model_copy(update={"policy_version": 1}) for r in generated(world["honest"], lease, state.sampling, CHEAT)]
    else:  # random tokens, each claimed with probability 1/V: self-consistent but not the policy's
        generator = torch.Generator().manual_seed(0)
        vocab = state.vocab_size
        rollouts = []
        for _ in range(lease.group_size):
            ids = torch.randint(3, vocab, (6,), generator=generator).tolist()
            rollouts.append(Rollout(
                rollout_id=uuid.uuid4().hex, run_name="unit", lease_id=lease.lease_id, prompt_id=lease.prompt_id,
                worker_id="w0", policy_version=0, prompt_token_ids=lease.prompt_token_ids, completion_token_ids=ids,
                logprobs=[-math.log(vocab)] * 6, finish_reason="length", sampling=state.sampling, claimed_reward=1.0,
            ))
    assert state.ingest(rollouts, CHEAT).accepted == 3
    assert not state.ready, "held back until checked"
    failures = verify_all(state, verifier)
    assert set(failures.values()) == {"logprob_mismatch"} and len(failures) == 3
    assert not state.ready and state.dropped["failed_verification"] == 0  # all three rejected
    assert state.rejected["logprob_mismatch"] == 3
    assert state.new_bans == ["mallory"]
    assert (
        state.grant_leases(CHEAT, 1)
        and state.ingest(generated(world["honest"], state.leases[next(iter(state.leases))].lease, state.sampling, CHEAT), CHEAT)
        .rejected[0]
        .reason
        == "banned"
    )


def test_replays_future_versions_and_false_finish_reasons_are_strikes(
    setup: Any, world: dict[str, Any], make_rollout: Any
) -> None:
    state, verifier = setup(new_worker_checks=0, max_strikes=4)
    first = state.grant_leases(CHEAT, 1)[0]
    honest = generated(world["honest"], first, state.sampling, CHEAT)
    assert state.ingest(honest, CHEAT).accepted == 3
    again = state.grant_leases(CHEAT, 1)[0]
    # The same content under new rollout ids, for another lease of the same prompt.
    state.leases[again.lease_id].lease = again = again.model_copy(
        update={"prompt_id": first.prompt_id, "prompt_token_ids": first.prompt_token_ids}
    )
    # v0's content again under new rollout ids, claimed as v1's (identical logprobs under new weights).
    state.announce(1)
    replay = [r.model_copy(update={"rollout_id": uuid.uuid4().hex, "lease_id": again.lease_id, "policy_version": 1}) for r in honest]
    assert {r.reason for r in state.ingest(replay[:1], CHEAT).rejected} == {"replay"}
    future = make_rollout(again, "1234", policy_version=5)
    assert {r.reason for r in state.ingest([future], CHEAT).rejected} == {"future_version"}
    assert state.integrity.workers["mallory"].strikes == 2 and not state.new_bans
    lying = make_rollout(again, [4, 5, 6])  # "stop" without end-of-sequence or a stop string
    assert {r.reason for r in state.ingest([lying], CHEAT).rejected} == {"bad_finish_reason"}
    short = make_rollout(again, [4, 5, 6, 2][:3] + [7], finish_reason="length")  # 4 tokens, max_tokens 6
    assert state.ingest([short], CHEAT).rejected[0].reason == "bad_finish_reason"
    assert state.new_bans == ["mallory"]
    # What the banned token left waiting never reaches the trainer; its prompt goes out again.
    assert state.drop_banned("mallory") == 0  # dropped when it was banned
    assert not state.ready and not state.leases and state.dropped["banned_worker"] == 3


def test_identical_honest_samples_are_no_replay(setup: Any, make_rollout: Any) -> None:
    """Within a group, and in another lease of the same prompt under the same version (a prompt
    that comes back within one version): honest coincidences, accepted."""
    state, _ = setup(new_worker_checks=0)
    lease = state.grant_leases(HONEST, 1)[0]
    same = [make_rollout(lease, "1234") for _ in range(3)]
    assert state.ingest(same, HONEST).accepted == 3
    other = state.grant_leases(HONEST, 1)[0]
    state.leases[other.lease_id].lease = other = other.model_copy(
        update={"prompt_id": lease.prompt_id, "prompt_token_ids": lease.prompt_token_ids}
    )
    assert state.ingest([make_rollout(other, "1234")], HONEST).accepted == 1
    assert state.integrity.workers["honest"].strikes == 0


def test_adversaries_on_loopback_are_banned_and_flooding_is_limited(
    make_config: Any, tokenizer: PreTrainedTokenizerBase, world: dict[str, Any], tmp_path: Any,
    serve_orchestrator: Any,
) -> None:
    """The real app: a cheating worker posting foreign-model rollouts is banned (its token then gets
    401) while an honest one is not; a flood over the rate limit gets 429."""
    tokens = [
        {"name": "honest", "role": "worker", "token": "h"}, {"name": "mallory", "role": "worker", "token": "m"},
        {"name": "flood", "role": "worker", "token": "f"},
    ]
    config = make_config(
        orchestrator={"verification": {"enabled": True, "new_worker_checks": 8, "max_strikes": 2},
                      # Lease answers at once: a long-poll would pace the flood below the limit.
                      "rate_limit_per_s": 1.0, "rate_limit_burst": 20, "lease_wait_s": 0.0},
    )
    state = RunState(config=config, task=build_task(config.task), tokenizer=tokenizer)
    state.announce(0)
    verifier = Verifier(config.orchestrator.verification, store=world["store"], cache_dir=str(tmp_path / "vc"), build=build_tiny)
    registry = TokenRegistry(tokens)

    async def scenario() -> None:
        async with serve_orchestrator(state, registry, store_url="memory://x", verifier=verifier) as server:
            async def post(token: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
                status, answer, _ = await server.call("POST", "/v1" + path, token, json=body)
                return status, answer

            for token, backend in (("h", world["honest"]), ("m", world["foreign"])):
                status, granted = await post(token, "/leases", {"worker_id": "w0", "max_groups": 1})
                lease = Lease(**granted["leases"][0])
                rollouts = await asyncio.to_thread(generated, backend, lease, state.sampling)
                status, _ = await post(token, "/rollouts", {"rollouts": [r.model_dump() for r in rollouts]})
                assert status == 200
            for _ in range(600):  # the verifier thread judges both groups
                if not state.pending and not state.verify_queue:
                    break
                await asyncio.sleep(0.05)
            status, _ = await post("m", "/leases", {"worker_id": "w0", "max_groups": 1})
            assert status == 401  # revoked
            status, _ = await post("h", "/leases", {"worker_id": "w0", "max_groups": 1})
            assert status == 200
            statuses = [(await post("f", "/leases", {"worker_id": "w0", "max_groups": 1}))[0] for _ in range(30)]
            assert statuses.count(429) >= 5 and statuses[:20] == [200] * 20
            _, seen, _ = await server.call("GET", "/v1/status", "h")
        assert seen["workers"]["mallory"]["banned"] and not seen["workers"]["honest"]["banned"]
        assert seen["verification"]["rollouts_checked"] == 6
        assert seen["groups_ready"] == 1  # the honest group only

    asyncio.run(asyncio.wait_for(scenario(), timeout=90))


def test_models_built_at_startup_take_every_version_in_place(
    setup: Any, world: dict[str, Any], tmp_path: Any
) -> None:
    """With `build` (as `decentrl orchestrator` passes it) warm_up builds the models once; each
    version is then read from the store, verified and copied in: honest rollouts pass, the
    foreign model's fail, and nothing is pulled into the cache directory."""
    state, _ = setup(new_worker_checks=1000)
    cache = tmp_path / "built"
    verifier = Verifier(
        state.config.orchestrator.verification, store=world["store"], cache_dir=str(cache),
        build=lambda: build_model(TinyModelConfig(**TINY, seed=7)),
    )
    verifier.warm_up()
    assert verifier.startup_s > 0 and len(verifier._spare) == verifier.config.models_cached
    lease = state.grant_leases(HONEST, 1)[0]
    honest = generated(world["honest"], lease, state.sampling)
    foreign = [r.model_copy(update={"rollout_id": uuid.uuid4().hex}) for r in generated(world["foreign"], lease, state.sampling)]
    failed = verifier.check(honest + foreign)
    assert failed == {r.rollout_id: "logprob_mismatch" for r in foreign}
    assert verifier.loads == 1 and verifier.largest_passing_diff < 1e-5 and not cache.exists()
    # v1 (another seed) goes into the spare model; v0's rollouts claimed as v1's now fail.
    as_v1 = [r.model_copy(update={"policy_version": 1}) for r in honest]
    assert set(verifier.check(as_v1).values()) == {"logprob_mismatch"}
    assert verifier.check(honest) == {} and verifier.loads == 2  # v0 still loaded
    summary = verifier.summary()
    assert summary["checks"] == 3 and summary["load_cpu_s"] > 0 and summary["forward_cpu_s"] > 0


def test_a_tampered_version_is_unverifiable_and_no_strike(
    setup: Any, world: dict[str, Any], tmp_path: Any
) -> None:
    """A version whose weights no longer match the manifest's sha256 is never loaded: its
    rollouts are left unjudged (`unverifiable`, the group dropped), and nobody gets a strike."""
    store = CheckpointStore(f"file://{tmp_path}/store")
    publish(store, str(tmp_path), 0, seed=0)
    weights = next((tmp_path / "store" / "v000000").glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    state, _ = setup(new_worker_checks=1000)
    verifier = Verifier(
        state.config.orchestrator.verification, store=store, cache_dir=str(tmp_path / "vc"),
        build=lambda: build_model(TinyModelConfig(**TINY)),
    )
    verifier.warm_up()
    lease = state.grant_leases(HONEST, 1)[0]
    assert state.ingest(generated(world["honest"], lease, state.sampling), HONEST).accepted == 3
    failures = verify_all(state, verifier)
    assert set(failures.values()) == {"unverifiable"} and len(failures) == 3
    assert state.integrity.workers["honest"].strikes == 0 and not state.ready
    assert verifier.loads == 0


def test_one_load_path_whose_failures_reach_the_caller(setup: Any, world: dict[str, Any], tmp_path: Any) -> None:
    """No second way to load a version: a model that cannot be built fails warm_up and then the
    check itself (the verification loop logs it and drops the groups unjudged); a built model
    that the version's weights do not fit leaves the rollouts `unverifiable`, nobody struck."""
    state, _ = setup(new_worker_checks=1000)

    def cannot_build() -> torch.nn.Module:
        raise RuntimeError("out of memory")

    broken = Verifier(state.config.orchestrator.verification, store=world["store"], cache_dir=str(tmp_path / "a"), build=cannot_build)
    with pytest.raises(RuntimeError, match="out of memory"):
        broken.warm_up()
    lease = state.grant_leases(HONEST, 1)[0]
    rollouts = generated(world["honest"], lease, state.sampling)
    with pytest.raises(RuntimeError, match="out of memory"):
        broken.check(rollouts)
    assert not (tmp_path / "a").exists()  # nothing pulled to load some other way

    wider = Verifier(
        state.config.orchestrator.verification, store=world["store"], cache_dir=str(tmp_path / "b"),
        build=lambda: build_model(TinyModelConfig(**{**TINY, "intermediate_size": 96})),
    )
    assert set(wider.check(rollouts).values()) == {"unverifiable"} and wider.loads == 0


@pytest.mark.kernels
def test_a_lora_adapter_version_is_checked_merged_onto_its_base(setup: Any, tmp_path: Any) -> None:
    """In LoRA runs a version is an adapter on version 0: the verifier pulls both and merges them,
    as the HF worker does (decentrl/store/weights.py). The adapted worker's rollouts pass; the base
    model's, claimed as the adapter version's, fail."""
    store = CheckpointStore(f"file://{tmp_path}/store")
    publish(store, str(tmp_path), 0, seed=0)
    publish_adapter(store, str(tmp_path), 1, base_version=0)
    worker, base = HFBackend(seed=0), HFBackend(seed=0)
    worker.load(store.pull(1, str(tmp_path / "worker-cache")), 1)
    base.load(store.pull(0, str(tmp_path / "worker-cache")), 0)

    state, _ = setup(new_worker_checks=1000)
    cache = tmp_path / "vc"
    verifier = Verifier(state.config.orchestrator.verification, store=store, cache_dir=str(cache), build=build_tiny)
    lease = state.grant_leases(HONEST, 1)[0]
    honest = [r.model_copy(update={"policy_version": 1}) for r in generated(worker, lease, state.sampling)]
    claimed = [r.model_copy(update={"policy_version": 1}) for r in generated(base, lease, state.sampling)]
    assert verifier.check(honest + claimed) == {r.rollout_id: "logprob_mismatch" for r in claimed}
    assert verifier.largest_passing_diff < 1e-5 and verifier.loads == 1
    assert sorted(os.listdir(cache)) == ["v000000", "v000001"]


def test_take_checks_takes_one_group_of_a_token_without_a_passed_check(
    make_config: Any, tokenizer: PreTrainedTokenizerBase, make_rollout: Any
) -> None:
    """Batches are whole groups, oldest first, up to the rollout limit; a token whose checks have
    not passed yet gets one group in (a cheater is banned on it before the rest costs anything)."""

    config = make_config(
        orchestrator={"verification": {"enabled": True, "new_worker_checks": 1000}}, trainer={"groups_per_step": 8}
    )
    state = RunState(config=config, task=build_task(config.task), tokenizer=tokenizer)
    state.announce(0)
    for holder in (CHEAT, CHEAT, HONEST, CHEAT, HONEST):
        lease = state.grant_leases(holder, 1)[0]
        state.ingest([make_rollout(lease, "1234", worker_id=holder.split("/")[1]) for _ in range(3)], holder)
    assert len(state.verify_queue) == 5
    first = state.take_checks(limit=100)
    assert [job.holder for job in first] == [CHEAT, HONEST] and len(state.verify_queue) == 3
    state.integrity.record(HONEST).passed = 1  # its first check passed: no longer held to one group
    assert [job.holder for job in state.take_checks(limit=100)] == [CHEAT, HONEST]
    assert [job.holder for job in state.take_checks(limit=1)] == [CHEAT]  # at least one group, even over the limit
    assert not state.verify_queue


def test_a_batch_waits_for_a_held_back_group_ahead_of_it_which_keeps_its_place(
    make_config: Any, tokenizer: PreTrainedTokenizerBase, make_rollout: Any
) -> None:
    """A group held back for its check keeps its place in line: a batch that would skip it waits
    for the check (checks_due says to check at once), and the checked group trains first, as its
    lease was budgeted for; groups behind a full batch may wait for others to share a forward."""

    config = make_config(orchestrator={"verification": {"enabled": True, "new_worker_checks": 3, "spot_check_fraction": 0.0}})
    state = RunState(config=config, task=build_task(config.task), tokenizer=tokenizer)
    state.announce(0)
    first, second, third = state.grant_leases(HONEST, 3)
    for lease in (first, second, third):
        assert state.ingest([make_rollout(lease, "1234") for _ in range(3)], HONEST).accepted == 3
    assert list(state.pending) == [first.lease_id] and [g.lease_id for g in state.ready] == [second.lease_id, third.lease_id]
    assert state.buffer.pending_ahead(2) and state.checks_due()
    assert state.take_batch(0) is None  # would skip the held-back group
    state.verify_queue.clear()
    state.verification_done({first.lease_id: {}})
    batch = state.take_batch(0)
    assert batch is not None and [s.group_id for s in batch.samples][::3] == [first.lease_id, second.lease_id]
    assert not state.buffer.pending_ahead(2) and not state.checks_due()


# -- the scheduler (orchestrator/verification.py) in the real app ---------------------------


class PassingVerifier:
    """Stands in for Verifier in the app: every check passes; records the rollouts per check."""

    def __init__(self) -> None:
        self.checked: list[int] = []

    def warm_up(self) -> None:
        pass

    def check(self, rollouts: list[Rollout]) -> dict[str, str]:
        self.checked.append(len(rollouts))
        return {}

    def summary(self) -> dict[str, float]:
        return {"rollouts_checked": float(sum(self.checked))}


# Every group held back, and never checked for company's sake within a test's time: only a
# wake-up (a batch that needs the check) starts one.
PATIENT = {"enabled": True, "new_worker_checks": 1000, "spot_check_fraction": 0.0, "check_wait_s": 60.0,
           "check_batch_rollouts": 1000}
WORKER_TOKENS = [{"name": "honest", "role": "worker", "token": "h"}, {"name": "t", "role": "trainer", "token": "t"}]


async def _batch_within(server: Any, seconds: float) -> dict[str, Any]:
    """The trainer's long-poll, asked again until a batch comes; fails after `seconds`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while loop.time() < deadline:
        status, body, _ = await server.call("GET", "/v1/batch?trainer_version=0", "t")
        if status == 200:
            return body
        assert status == 204
    raise AssertionError(f"no batch within {seconds} s")


def test_the_scheduler_sleeps_until_a_batch_needs_a_check(
    make_config: Any, tokenizer: PreTrainedTokenizerBase, make_rollout: Any, serve_orchestrator: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Held-back groups not yet needed wait (check_wait_s is long) without the scheduler polling
    them; the post that completes the trainer's batch wakes it, and the batch follows at once."""
    looks: list[bool] = []
    real_checks_due = RunState.checks_due

    def counted(state: RunState) -> bool:
        looks.append(real_checks_due(state))
        return looks[-1]

    monkeypatch.setattr(RunState, "checks_due", counted)
    config = make_config(orchestrator={"verification": PATIENT})
    state = RunState(config=config, task=build_task(config.task), tokenizer=tokenizer)
    state.announce(0)
    verifier = PassingVerifier()

    async def scenario() -> None:
        async with serve_orchestrator(state, TokenRegistry(WORKER_TOKENS), verifier=verifier) as server:
            first, second = state.grant_leases(HONEST, 2)
            body = RolloutBatch(rollouts=[make_rollout(first, "1234") for _ in range(3)]).model_dump_json()
            assert (await server.call("POST", "/v1/rollouts", "h", data=body))[0] == 200
            await asyncio.sleep(1.0)
            # One look when the post woke it (not due: one group of the two a batch takes), then
            # asleep: a poll every 0.05 s would have looked about 20 times.
            assert looks == [False] and verifier.checked == [] and len(state.pending) == 1
            body = RolloutBatch(rollouts=[make_rollout(second, "4321") for _ in range(3)]).model_dump_json()
            assert (await server.call("POST", "/v1/rollouts", "h", data=body))[0] == 200
            started = asyncio.get_running_loop().time()
            batch = await _batch_within(server, 10.0)
            assert asyncio.get_running_loop().time() - started < 10.0
        assert [s["group_id"] for s in batch["samples"]][::3] == [first.lease_id, second.lease_id]
        assert sum(verifier.checked) == 6  # the first group alone (a token's first check), then the second

    asyncio.run(asyncio.wait_for(scenario(), timeout=60))


def test_groups_recovered_held_back_are_checked_at_startup(
    make_config: Any, tokenizer: PreTrainedTokenizerBase, make_rollout: Any, serve_orchestrator: Any, tmp_path: Any,
) -> None:
    """Groups held back when the orchestrator stopped are checked when it starts again, with no
    post to wake the scheduler: the trainer's batch comes."""
    from orchestrator.journal import Journal

    config = make_config(orchestrator={"verification": PATIENT})
    path = str(tmp_path / "journal.sqlite")
    journal = Journal(path, run_name=config.run_name)
    before = RunState(config=config, task=build_task(config.task), tokenizer=tokenizer, journal=journal)
    before.announce(0)
    for lease in before.grant_leases(HONEST, 2):
        assert before.ingest([make_rollout(lease, "1234") for _ in range(3)], HONEST).accepted == 3
    assert len(before.pending) == 2
    journal.flush()
    journal.close()
    journal = Journal(path, run_name=config.run_name)
    state = RunState(config=config, task=build_task(config.task), tokenizer=tokenizer, journal=journal)
    assert len(state.verify_queue) == 2 and not state.ready
    verifier = PassingVerifier()

    async def scenario() -> None:
        async with serve_orchestrator(state, TokenRegistry(WORKER_TOKENS), verifier=verifier) as server:
            batch = await _batch_within(server, 10.0)
            assert len(batch["samples"]) == 6

    asyncio.run(asyncio.wait_for(scenario(), timeout=60))
    journal.close()
    assert sum(verifier.checked) == 6


@pytest.mark.parametrize("read", ["in memory", "pulled"])
@pytest.mark.parametrize("damage", ["header-size bomb", "malformed header", "wrong shape", "missing tensor", "files: []"])
def test_a_version_that_verifies_but_does_not_load_is_unverifiable(
    damage: str, read: str, setup: Any, world: dict[str, Any], tmp_path: Any
) -> None:
    """Whatever a version holds, the verifier's loader turns a failure into `unverifiable` for the
    rollouts that need it (no strike), and the verifier goes on. A full version is read into
    memory; an adapter version's damaged base is pulled into the cache."""
    import json
    import struct

    from safetensors.torch import load_file, save_file

    store = CheckpointStore(f"file://{tmp_path}/store")
    directory = publish(store, str(tmp_path), -1, seed=0)  # written, published below
    weights = os.path.join(directory, "model.safetensors")
    state = load_file(weights)
    first = sorted(state)[0]
    if damage == "header-size bomb":
        Path(weights).write_bytes(struct.pack("<Q", 2**62) + b"{}")
    elif damage == "malformed header":
        Path(weights).write_bytes(struct.pack("<Q", 8) + b"{not js}" + bytes(32))
    elif damage == "wrong shape":
        state[first] = torch.zeros(state[first].shape[0] + 1, *state[first].shape[1:])
        save_file(state, weights)
    elif damage == "missing tensor":
        del state[first]
        save_file(state, weights)
    store.publish(0, directory)
    if damage == "files: []":
        manifest = tmp_path / "store" / "v000000" / "manifest.json"
        manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "files": []}))
    version = 0 if read == "in memory" else 1
    if read == "pulled":
        publish_adapter(store, str(tmp_path), 1, base_version=0)
    state_, _ = setup(new_worker_checks=1000)
    state_.announce(version)
    verifier = Verifier(state_.config.orchestrator.verification, store=store, cache_dir=str(tmp_path / "vc"), build=build_tiny)
    verifier.warm_up()
    lease = state_.grant_leases(HONEST, 1)[0]
    rollouts = [r.model_copy(update={"policy_version": version}) for r in generated(world["honest"], lease, state_.sampling)]
    assert state_.ingest(rollouts, HONEST).accepted == 3
    failures = verify_all(state_, verifier)
    assert set(failures.values()) == {"unverifiable"} and len(failures) == 3
    assert state_.integrity.workers["honest"].strikes == 0 and verifier.loads == 0
