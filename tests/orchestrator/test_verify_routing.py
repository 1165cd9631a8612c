"""The verifier replays MoE routes (issue 15): a real Verifier over a real file:// store holding a
tiny MoE, rollouts from the real hf backend. An honest MoE worker passes its spot checks; one
that lies about its routes, or about its logprobs, fails them."""

from __future__ import annotations

import os
import uuid
from typing import Any

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from decentrl.api.wire import ExpertRouting, Lease, Rollout, SamplingParams
from decentrl.config import TinyModelConfig
from decentrl.model.build import build_model, build_tiny_tokenizer
from decentrl.store.checkpoints import CheckpointStore
from decentrl.store.weights import write_hf_dir
from decentrl.tasks import build_task
from orchestrator.state import RunState
from orchestrator.verify import Verifier
from workers.backends.hf import HFBackend

MOE = {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64,
       "moe": {"num_experts": 4, "top_k": 2, "expert_intermediate_size": 16}}
HOLDER = "honest/w0"


@pytest.fixture(scope="module")
def world(tmp_path_factory: Any) -> dict[str, Any]:
    tmp = str(tmp_path_factory.mktemp("verify-moe"))
    store = CheckpointStore(f"file://{tmp}/store")
    model = build_model(TinyModelConfig(**MOE))
    with torch.no_grad():  # experts that differ materially, as trained ones do: at init a route barely matters
        for name, parameter in model.named_parameters():
            if ".experts." in name:
                parameter.mul_(30)
    directory = os.path.join(tmp, "v0")
    os.makedirs(directory)
    build_tiny_tokenizer().save_pretrained(directory)
    model.generation_config.save_pretrained(directory)
    write_hf_dir(directory, model.state_dict(), model.config, extras_from=directory)
    store.publish(0, directory)
    backend = HFBackend(seed=0)
    backend.load(store.pull(0, os.path.join(tmp, "worker-cache")), 0)
    return {"store": store, "backend": backend}


@pytest.fixture
def setup(make_config: Any, tokenizer: PreTrainedTokenizerBase, world: dict[str, Any], tmp_path: Any) -> tuple[RunState, Verifier]:
    options = {"enabled": True, "new_worker_checks": 1000, "spot_check_fraction": 0.0, "max_strikes": 100}
    config = make_config(model=MOE, orchestrator={"verification": options})
    state = RunState(config=config, task=build_task(config.task), tokenizer=tokenizer)
    state.announce(0)
    verifier = Verifier(
        config.orchestrator.verification, store=world["store"], cache_dir=str(tmp_path / "vcache"),
        build=lambda: build_model(TinyModelConfig(**MOE, seed=7)),
    )
    return state, verifier


def generated(backend: HFBackend, lease: Lease, sampling: SamplingParams) -> list[Rollout]:
    completions = backend.generate([lease.prompt_token_ids] * lease.group_size, sampling)
    return [
        Rollout(
            rollout_id=uuid.uuid4().hex, run_name="unit", lease_id=lease.lease_id, prompt_id=lease.prompt_id,
            worker_id="w0", policy_version=0, prompt_token_ids=lease.prompt_token_ids, completion_token_ids=c.token_ids,
            logprobs=c.logprobs, finish_reason=c.finish_reason, sampling=sampling, expert_routing=c.routes,
        )
        for c in completions
    ]


@pytest.mark.kernels
def test_honest_moe_rollouts_pass_and_lies_about_routes_or_logprobs_fail(setup: tuple[RunState, Verifier], world: dict[str, Any]) -> None:
    state, verifier = setup
    honest = [r for lease in state.grant_leases(HOLDER, 2) for r in generated(world["backend"], lease, state.sampling)]
    assert all(r.expert_routing is not None for r in honest)
    assert verifier.check(honest) == {}
    assert verifier.largest_passing_diff < verifier.config.tolerance / 10

    def lie_routes(r: Rollout) -> Rollout:
        assert r.expert_routing is not None
        shifted = [(e + 1) % 4 for e in r.expert_routing.experts]  # other experts, still valid ids and distinct
        return r.model_copy(update={"expert_routing": ExpertRouting(layers=2, top_k=2, experts=shifted)})

    def lie_logprobs(r: Rollout) -> Rollout:
        return r.model_copy(update={"logprobs": [lp / 2 for lp in r.logprobs]})

    for lie in (lie_routes, lie_logprobs):
        failed = verifier.check([lie(r) for r in honest])
        assert set(failed) == {r.rollout_id for r in honest if len(r.completion_token_ids) > 0}, lie.__name__


def test_an_moe_run_rejects_a_rollout_without_routes_at_ingest(setup: tuple[RunState, Verifier], world: dict[str, Any]) -> None:
    state, _ = setup
    (lease,) = state.grant_leases(HOLDER, 1)
    rollouts = [r.model_copy(update={"expert_routing": None}) for r in generated(world["backend"], lease, state.sampling)]
    result = state.ingest(rollouts, HOLDER)
    assert result.accepted == 0 and {r.reason for r in result.rejected} == {"bad_expert_routing:missing"}
