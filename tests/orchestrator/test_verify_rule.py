"""The verifier's rule without a model: its bounds in the config, a claimed token at the top-k/top-p
boundary that rounding moved (orchestrator/verify.py `_judged_at_the_boundary`), and the start-up
refusal of half-precision versions in a deterministic run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from decentrl.api.wire import SamplingParams
from decentrl.config import ConfigError, PretrainedModelConfig, load_config
from decentrl.model.build import publish_dtype_name
from decentrl.model.sampling import sampling_distribution
from orchestrator.app import StartupError, build_verifier
from orchestrator.verify import _judged_at_the_boundary

PUBLIC = str(Path(__file__).resolve().parents[2] / "configs" / "public.toml")


def test_an_old_config_keeps_its_tolerance_and_gets_the_half_precision_bounds() -> None:
    verification = load_config(PUBLIC, ["orchestrator.verification.tolerance=0.02"]).orchestrator.verification
    assert verification.tolerance == 0.02  # fp32 versions, as before
    assert (verification.half_tolerance, verification.half_mean_tolerance) == (1.5, 0.15)


@pytest.mark.parametrize("override, says", [
    ("half_mean_tolerance=2", "half_mean_tolerance (2.0) is above half_tolerance (1.5)"),
    ("half_tolerance=0", "orchestrator.verification.half_tolerance: Input should be greater than 0"),
    ("half_mean_tolerance=-0.1", "orchestrator.verification.half_mean_tolerance: Input should be greater than 0"),
])
def test_bad_bounds_are_refused_naming_the_field(override: str, says: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(PUBLIC, [f"orchestrator.verification.{override}"])
    assert says in str(info.value)


def judged(logits: list[float], target: int, sampling: SamplingParams, slack: float) -> float:
    rows, targets = torch.tensor([logits]), torch.tensor([[target]])
    chosen = sampling_distribution(rows, sampling).gather(-1, targets).squeeze(-1)
    return float(_judged_at_the_boundary(rows, targets, chosen, sampling, slack)[0])


def test_a_token_just_past_the_top_k_boundary_is_judged_as_kept() -> None:
    """Top-2: the third token, 0.01 below the second, is what a worker rounding the other way kept."""
    sampling = SamplingParams(temperature=1.0, top_k=2, max_tokens=1)
    logits = [2.0, 1.0, 0.99, -3.0]
    assert judged(logits, 2, sampling, slack=0.05) == pytest.approx(0.99 - torch.tensor([2.0, 1.0, 0.99]).logsumexp(0).item())
    assert judged(logits, 2, sampling, slack=0.001) == float("-inf")  # not within the slack
    assert judged(logits, 3, sampling, slack=1.5) == float("-inf")  # far past it: no rounding moves it
    assert judged(logits, 1, sampling, slack=1.5) == pytest.approx(1.0 - torch.tensor([2.0, 1.0]).logsumexp(0).item())


def test_a_token_just_past_the_top_p_boundary_is_judged_as_kept() -> None:
    """Top-p 0.9: the first token alone holds just over 0.9, so the second is dropped - by a margin
    that a worker's rounding can close."""
    sampling = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=1)
    logits = [0.0, -2.25, -6.0, -6.0]  # p = 0.903, 0.095, 0.002, 0.002
    assert judged(logits, 1, sampling, slack=0.1) == pytest.approx(-2.25 - torch.tensor([0.0, -2.25]).logsumexp(0).item())
    assert judged(logits, 2, sampling, slack=0.1) == float("-inf")


def test_a_deterministic_run_with_verification_refuses_half_precision_versions_at_start_up(
    make_config: Any, tmp_path: Path, chat_dir: Path,
) -> None:
    """Its seeded re-draw does not reproduce bf16 sampling (docs/store.md): the orchestrator says
    so before it opens anything, naming the setting; fp32 versions start."""
    verification = {"verification": {"enabled": True}}
    bf16 = make_config(deterministic=True, orchestrator=verification, store={"publish_dtype": "bf16"})
    with pytest.raises(StartupError, match='store.publish_dtype = "fp32"'):
        build_verifier(bf16, str(tmp_path))
    assert build_verifier(make_config(deterministic=True, orchestrator=verification), str(tmp_path)) is not None
    assert build_verifier(make_config(orchestrator=verification, store={"publish_dtype": "bf16"}), str(tmp_path)) is not None
    # A pretrained model's own dtype counts when store.publish_dtype is not set (read from its config.json).
    config = json.loads((chat_dir / "config.json").read_text())
    model_dir = tmp_path / "bf16-model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16", "torch_dtype": None}))
    own = bf16.store.model_copy(update={"publish_dtype": None})
    assert publish_dtype_name(own, PretrainedModelConfig(path=str(model_dir))) == "bfloat16"
