"""Keep Routing on the worker (issue 15), through the real hf backend, the worker's batcher
(workers/batching.py, which interrupts on `should_stop` and continues) and `Sample.extend_routes`:
a partial rollout keeps the routes recorded before a weight swap and the continuation adds the
rest; a multi-turn episode's environment tokens get the routes of the next model turn's forward;
[simulation] router_noise changes the choice and the recording follows it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from decentrl.api.wire import SamplingParams
from decentrl.config import TinyModelConfig
from decentrl.model.build import build_model, build_tiny_tokenizer
from decentrl.model.routers import RouteRecorder
from decentrl.model.routing import routing_problem, spec_of
from decentrl.store.weights import write_hf_dir
from workers.backends.hf import HFBackend
from workers.batching import Batcher
from workers.sample import Sample

MOE = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                      moe={"num_experts": 8, "top_k": 2, "expert_intermediate_size": 16})
PROMPTS = [[1, 4, 5, 6], [1, 7, 8, 9, 10, 11]]
MAX_TOKENS, BEFORE_SWAP = 12, 5


def version_dir(tmp_path: Path, seed: int) -> str:
    """A version as the trainer publishes it (decentrl/store/weights.py `write_hf_dir`)."""
    model = build_model(MOE.model_copy(update={"seed": seed}))
    model.generation_config.eos_token_id = None  # run to max_tokens: long enough to be cut by the swap
    directory = str(tmp_path / f"v{seed}")
    build_tiny_tokenizer().save_pretrained(directory)
    model.generation_config.save_pretrained(directory)
    write_hf_dir(directory, model.state_dict(), model.config, extras_from=directory)
    return directory


def recorded_routes(directory: str, token_ids: list[int]) -> torch.Tensor:
    """(T, layers, K) experts a plain full forward of the version at `directory` routes `token_ids` to."""
    model = HFBackend()
    model.load(directory, 0)
    assert model.model is not None
    with torch.no_grad(), RouteRecorder(model.model) as recorder:
        model.model(input_ids=torch.tensor([token_ids]))
        return recorder.take().view(len(token_ids), recorder.layers, -1)


def as_sets(routes: torch.Tensor) -> torch.Tensor:
    return routes.sort(dim=-1).values


def test_a_partial_rollout_keeps_the_routes_recorded_before_the_swap(tmp_path: Path) -> None:
    old, new = version_dir(tmp_path, 0), version_dir(tmp_path, 1)
    backend = HFBackend(seed=0)
    backend.load(old, 0)
    batcher = Batcher(max_rows=8)
    sampling = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS)
    samples = [Sample(prompt=p, budget=MAX_TOKENS) for p in PROMPTS]

    # Round 1 under version 0, interrupted (a soft-pause deadline) after BEFORE_SWAP tokens.
    asked = iter(range(1000))
    request = batcher.submit(samples, sampling)
    assert batcher.lead(request)
    batcher.generate_next(backend, 0, lambda: next(asked) >= BEFORE_SWAP - 1)
    assert all(len(s.token_ids) == BEFORE_SWAP and s.finish_reason is None for s in samples)
    before = [torch.tensor(s.routes.experts).view(-1, 2, 2).clone() for s in samples]  # type: ignore[union-attr]

    backend.load(new, 1)  # the swap: new weights copied in place
    request = batcher.submit(samples, sampling)
    assert batcher.lead(request)
    batcher.generate_next(backend, 1, lambda: False)

    spec = spec_of(MOE)
    for sample, kept in zip(samples, before, strict=True):
        assert sample.finish_reason == "length" and sample.versions == [0] * BEFORE_SWAP + [1] * (MAX_TOKENS - BEFORE_SWAP)
        fed = sample.prompt + sample.token_ids[:-1]  # every token but the last was fed to the model
        assert routing_problem(sample.routes, spec, True, len(sample.prompt) + len(sample.token_ids)) is None
        routes = torch.tensor(sample.routes.experts).view(len(fed), 2, 2)  # type: ignore[union-attr]
        # Rows of the tokens fed under version 0 (the prompt, the first BEFORE_SWAP - 1 tokens) stay
        # as recorded; the continuation's prefill re-routed them under version 1 and was not taken.
        cut = len(sample.prompt) + BEFORE_SWAP - 1
        assert torch.equal(routes[:cut], kept)
        under_old, under_new = recorded_routes(old, fed), recorded_routes(new, fed)
        assert torch.equal(as_sets(routes[:cut]), as_sets(under_old[:cut]))
        assert torch.equal(as_sets(routes[cut:]), as_sets(under_new[cut:]))
        # The versions route differently: taking the new rows for the old tokens would be caught.
        assert not torch.equal(as_sets(under_old[:cut]), as_sets(under_new[:cut]))


@pytest.mark.parametrize("noise", [0.0, 5.0])
def test_router_noise_changes_the_choice_and_the_recording_follows_it(tmp_path: Path, noise: float) -> None:
    """[simulation] router_noise: the recorded routes are those the noisy worker ran, so replaying
    them reproduces its logprobs, while its own routers would have chosen otherwise."""
    from decentrl.api.wire import TrainSample
    from decentrl.trainer.batching import collate
    from decentrl.trainer.step import token_logprobs

    directory = version_dir(tmp_path, 0)
    backend = HFBackend(seed=0, router_noise=noise)
    backend.load(directory, 0)
    completions = backend.generate(PROMPTS, SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS))
    samples = [
        TrainSample(prompt_token_ids=p, completion_token_ids=c.token_ids, logprobs=c.logprobs, advantage=0.0, reward=0.0,
                    policy_version=0, expert_routing=c.routes)
        for p, c in zip(PROMPTS, completions, strict=True)
    ]
    differs = 0
    for sample in samples:
        fed = sample.prompt_token_ids + sample.completion_token_ids[:-1]
        routes = torch.tensor(sample.expert_routing.experts).view(len(fed), 2, 2)  # type: ignore[union-attr]
        differs += int((as_sets(routes) != as_sets(recorded_routes(directory, fed))).any(-1).sum())
    assert (differs > 0) == (noise > 0)
    trainer = build_model(MOE).eval()
    batch = collate(samples, pad_id=0)
    with torch.no_grad():
        replayed = token_logprobs(trainer, batch, temperature=1.0)
    mask = batch.completion_mask.bool()
    assert torch.allclose(replayed[mask], batch.sampler_logprobs[mask], atol=1e-5)


def test_a_multi_turn_episode_carries_a_route_for_every_fed_token(tmp_path: Path) -> None:
    from decentrl.api.wire import Lease, TrainSample
    from decentrl.config import GuessTaskConfig
    from decentrl.tasks.episodes import tokenizer_codec
    from decentrl.tasks.guess import GuessTask
    from decentrl.trainer.batching import collate
    from decentrl.trainer.step import token_logprobs
    from workers.episodes import run_episodes

    directory = version_dir(tmp_path, 0)
    backend = HFBackend(seed=0)
    backend.load(directory, 0)
    batcher = Batcher(max_rows=8)

    def complete(samples: list[Sample], sampling: SamplingParams) -> None:
        request = batcher.submit(samples, sampling)
        while batcher.lead(request):
            batcher.generate_next(backend, 0, lambda: False)

    task = GuessTask(GuessTaskConfig(max_number=9, max_turns=3, num_prompts=8))
    codec = tokenizer_codec(build_tiny_tokenizer())
    leases = [Lease(lease_id=f"l{i}", prompt_id=i, prompt_token_ids=[1] + codec.encode(task.prompt(i).text),
                    group_size=1, deadline=0.0) for i in range(4)]
    episodes = run_episodes(leases, SamplingParams(temperature=1.0, max_tokens=12), task=task, codec=codec, complete=complete)
    assert any(0 in e.loss_mask for e in episodes)  # type: ignore[operator]  # some answered by the environment
    spec = spec_of(MOE)
    samples = []
    for episode in episodes:
        assert routing_problem(episode.routes, spec, True, len(episode.prompt) + len(episode.token_ids)) is None
        samples.append(TrainSample(
            prompt_token_ids=episode.prompt, completion_token_ids=episode.token_ids, logprobs=episode.logprobs,
            advantage=0.0, reward=0.0, policy_version=0, expert_routing=episode.routes, loss_mask=episode.loss_mask,
        ))
    # Replayed, the trainer reproduces every model token's logprob, the later turns' included
    # (their forward saw the environment's tokens routed as recorded).
    batch = collate(samples, pad_id=0)
    with torch.no_grad():
        replayed = token_logprobs(build_model(MOE).eval(), batch, temperature=1.0)
    mask = batch.completion_mask.bool()
    assert torch.allclose(replayed[mask], batch.sampler_logprobs[mask], atol=1e-5)


def test_routes_travel_only_in_a_keep_routing_run() -> None:
    """With keep_routing off the orchestrator rejects routes (`bad_expert_routing:not_kept`): the
    trainer replays whatever a batch carries, so an unreplayed run must not get any."""
    from decentrl.api.wire import ExpertRouting, Lease
    from workers.sample import to_rollout

    routes = ExpertRouting(layers=2, top_k=2, experts=[0, 1] * 4)
    sample = Sample(prompt=[1, 4], budget=2, token_ids=[5, 6], logprobs=[-1.0, -1.0], versions=[0, 0],
                    finish_reason="length", routes=routes)
    lease = Lease(lease_id="l0", prompt_id=0, prompt_token_ids=[1, 4], group_size=1, deadline=0.0)
    sampling = SamplingParams(temperature=1.0, max_tokens=2)
    assert to_rollout("r", "w", lease, sample, sampling, keep_routing=True).expert_routing == routes
    assert to_rollout("r", "w", lease, sample, sampling, keep_routing=False).expert_routing is None
