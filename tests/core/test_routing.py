"""Keep Routing (issue 15): the route layout on the wire, the named rejections, recording in the
hf backend and replay in the trainer's forward (decentrl/model/routing.py, decentrl/model/routers.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from decentrl.api.encoding import EXT_UINT8, EXT_UINT16, MEDIA_MSGPACK, encode_model, unpack_msgpack
from decentrl.api.wire import ExpertRouting, Rollout, RunInfo, SamplingParams, TrainSample
from decentrl.config import TinyModelConfig
from decentrl.model.build import build_model, build_tiny_tokenizer
from decentrl.model.routers import replaying, routers
from decentrl.model.routing import RouteSpec, keeps_routing, routing_problem, spec_of, spec_of_hf_config
from decentrl.trainer.batching import collate
from decentrl.trainer.step import model_logits, token_logprobs, token_stats
from workers.backends.hf import HFBackend
from workers.backends.openai import OpenAIBackend
from workers.worker import require_routes

MOE = TinyModelConfig(hidden_size=32, num_layers=3, num_heads=2, intermediate_size=64,
                      moe={"num_experts": 6, "top_k": 2, "expert_intermediate_size": 16, "dense_layers": [1]})
SPEC = RouteSpec(num_experts=6, top_k=2, sparse_layers=(0, 2))


def routing(rows: int, layers: int = 2, top_k: int = 2, experts: int = 6) -> ExpertRouting:
    return ExpertRouting(layers=layers, top_k=top_k, experts=[(i + i // top_k) % experts for i in range(rows * layers * top_k)])


def test_spec_of_the_tiny_moe_and_of_hf_configs() -> None:
    assert spec_of(MOE) == SPEC
    assert spec_of(TinyModelConfig()) is None
    assert keeps_routing(MOE, SPEC) and not keeps_routing(TinyModelConfig(), None)
    assert not keeps_routing(MOE.model_copy(update={"keep_routing": False}), SPEC)
    assert spec_of_hf_config(
        {"model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 4}
    ) == RouteSpec(8, 2, (0, 1, 2, 3))
    assert spec_of_hf_config({"model_type": "qwen2", "num_hidden_layers": 4}) is None
    with pytest.raises(ValueError, match="keep_routing = false"):
        spec_of_hf_config({"model_type": "deepseek_v3", "n_routed_experts": 64, "num_hidden_layers": 4})
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        TinyModelConfig(keep_routing=True)
    with pytest.raises(ValueError, match="top_k"):
        TinyModelConfig(moe={"num_experts": 2, "top_k": 3})


def test_routes_travel_as_one_byte_per_id_on_msgpack_and_as_a_list_in_json() -> None:
    for experts, code in ((6, EXT_UINT8), (300, EXT_UINT16)):
        routes = ExpertRouting(layers=2, top_k=2, experts=[experts - 1, 0] * 10)
        packed = encode_model(routes, MEDIA_MSGPACK)
        raw = unpack_msgpack(packed)
        assert raw["experts"].ext.code == code
        assert len(raw["experts"].ext.data) == 20 * (1 if code == EXT_UINT8 else 2)
        assert ExpertRouting.model_validate(raw) == routes
        assert ExpertRouting.model_validate_json(routes.model_dump_json()) == routes
        assert json.loads(routes.model_dump_json())["experts"][:2] == [experts - 1, 0]


@pytest.mark.parametrize(
    ("routes", "spec", "keep", "reason"),
    [
        (None, SPEC, True, "bad_expert_routing:missing"),
        (routing(5), None, False, "bad_expert_routing:dense_model"),
        (routing(4), SPEC, True, "bad_expert_routing:shape"),  # one row short
        (routing(5, layers=3), SPEC, True, "bad_expert_routing:shape"),  # a dense layer sent too
        (routing(5, top_k=1), SPEC, True, "bad_expert_routing:shape"),
        (ExpertRouting(layers=2, top_k=2, experts=[6, 0] * 10), SPEC, True, "bad_expert_routing:expert_out_of_range"),
        (ExpertRouting(layers=2, top_k=2, experts=[3, 3] * 10), SPEC, True, "bad_expert_routing:repeated_expert"),
        (routing(5), SPEC, False, "bad_expert_routing:not_kept"),  # keep_routing off: the trainer's routers decide
        (routing(5), SPEC, True, None),
        (None, SPEC, False, None),
        (None, None, False, None),
    ],
)
def test_each_bad_route_has_a_named_rejection(routes: ExpertRouting | None, spec: RouteSpec | None, keep: bool, reason: str | None) -> None:
    assert routing_problem(routes, spec, keep, tokens=6) == reason


def test_a_routing_run_refuses_a_backend_that_cannot_record() -> None:
    info = RunInfo(run_name="r", store_url="file:///x", policy_version=0, max_staleness=1, group_size=2, keep_routing=True)
    with pytest.raises(ValueError, match="cannot record routes"):
        require_routes(info, OpenAIBackend(url="http://127.0.0.1:1", model="m"))
    require_routes(info, HFBackend())
    require_routes(info.model_copy(update={"keep_routing": False}), OpenAIBackend(url="http://127.0.0.1:1", model="m"))


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("moe")
    build_model(MOE).save_pretrained(path)
    build_tiny_tokenizer().save_pretrained(path)
    return str(path)


def generated(moe_dir: str, prompts: list[list[int]], max_tokens: int = 5) -> tuple[HFBackend, list[TrainSample]]:
    backend = HFBackend(seed=3)
    backend.load(moe_dir, 0)
    sampling = SamplingParams(temperature=1.0, max_tokens=max_tokens)
    completions = backend.generate(prompts, sampling)
    samples = [
        TrainSample(prompt_token_ids=p, completion_token_ids=c.token_ids, logprobs=c.logprobs, advantage=0.0, reward=0.0,
                    policy_version=0, expert_routing=c.routes)
        for p, c in zip(prompts, completions, strict=True)
    ]
    return backend, samples


@pytest.mark.kernels
def test_hf_backend_records_every_fed_token_and_replay_reproduces_its_logprobs(moe_dir: str) -> None:
    prompts = [[1, 4, 5], [1, 6, 7, 8, 9, 3]]  # unequal: the shorter is left-padded by the worker
    backend, samples = generated(moe_dir, prompts)
    for sample in samples:
        assert sample.expert_routing is not None
        rows = len(sample.prompt_token_ids) + len(sample.completion_token_ids) - 1
        assert routing_problem(sample.expert_routing, SPEC, True, rows + 1) is None
    model = build_model(MOE).eval()
    batch = collate(samples, pad_id=0)
    with torch.no_grad():
        replayed = token_logprobs(model, batch, temperature=1.0)
    got = replayed[batch.completion_mask.bool()]
    want = batch.sampler_logprobs[batch.completion_mask.bool()]
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


def test_replay_forces_the_recorded_experts_and_the_router_still_gets_gradient(moe_dir: str) -> None:
    _, samples = generated(moe_dir, [[1, 4, 5, 6]], max_tokens=6)
    routes = samples[0].expert_routing
    assert routes is not None
    # Route every token elsewhere: the forward must follow the recording, not the router.
    forced = ExpertRouting(layers=2, top_k=2, experts=[(e + 3) % 6 for e in routes.experts])
    batch = collate([samples[0].model_copy(update={"expert_routing": forced})], pad_id=0)
    model = build_model(MOE).train()
    with replaying(model, batch.routes) as drift:
        logprobs, _ = token_stats(model_logits(model, batch), batch.targets, None, 1.0)
        logprobs.sum().backward()
    rows = len(forced.experts) // 4
    assert drift[0] == 2 * rows  # every fed row of both sparse layers replayed
    assert drift[1] > 0  # and where the forced set differs from the router's own, the forced one ran
    for router, _ in routers(model):
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    with torch.no_grad():
        free = token_logprobs(model, collate([samples[0]], pad_id=0), temperature=1.0)
    assert not torch.allclose(free, logprobs.detach())


def test_a_missing_route_row_keeps_the_routers_choice(moe_dir: str) -> None:
    """The last token's row (never fed at inference) is -1 in the batch: the router decides it."""
    _, samples = generated(moe_dir, [[1, 4, 5]])
    batch = collate(samples, pad_id=0)
    assert batch.routes is not None
    width = batch.input_ids.shape[1]
    assert (batch.routes[0, width - 1] == -1).all() and (batch.routes[0, : width - 1] >= 0).all()


def test_routes_for_a_model_with_other_layers_fail_clearly(moe_dir: str, tmp_path: Path) -> None:
    _, samples = generated(moe_dir, [[1, 4, 5]])
    batch = collate(samples, pad_id=0)
    other = build_model(MOE.model_copy(update={"moe": MOE.moe.model_copy(update={"dense_layers": ()})}))  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="routes for 2 sparse layers, but the model has 3"):
        token_logprobs(other, batch, temperature=1.0)


def test_rollout_routes_validate_strictly() -> None:
    with pytest.raises(ValueError):
        ExpertRouting(layers=0, top_k=2, experts=[])
    with pytest.raises(ValueError):
        ExpertRouting.model_validate({"layers": 1, "top_k": 2, "experts": ["a"]})
    assert Rollout.model_fields["expert_routing"].annotation == ExpertRouting | None
