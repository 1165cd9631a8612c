"""`[scorer]` (decentrl/config/scorer.py): a keyed union on `type` whose errors name the keys as
the file spells them; `decentrl scorer` takes only who it is and where it connects, refuses a
run config without a scorer and a backend that cannot start, before it connects; the python
backend imports its function and holds it to one verdict per item."""

from __future__ import annotations

import pytest
import typer.main
from typer.testing import CliRunner

from decentrl.api.wire import ScoreItem
from decentrl.cli.main import app
from decentrl.config import ConfigError, HFScorerConfig, JsonVerdictConfig, OpenAIScorerConfig, PythonScorerConfig, load_config
from workers.scorers import Verdict, build_scorer_backend
from workers.scorers.python import PythonScoreBackend

UNREACHABLE = "http://127.0.0.1:9"


def test_the_scorer_section_is_keyed_on_type() -> None:
    assert load_config(None).scorer is None  # runs that score with verifiers only
    hf = load_config(None, ["scorer.type=hf", "scorer.path=/models/rm", "scorer.device=cuda:1"]).scorer
    assert isinstance(hf, HFScorerConfig) and (hf.path, hf.device, hf.max_items) == ("/models/rm", "cuda:1", 16)
    judge = load_config(None, [
        "scorer.type=openai", "scorer.base_url=http://127.0.0.1:8000/v1", "scorer.model=judge",
        "scorer.verdict.type=json", "scorer.verdict.field=grade",
    ]).scorer
    assert isinstance(judge, OpenAIScorerConfig) and judge.verdict == JsonVerdictConfig(field="grade")
    python = load_config(None, ["scorer.type=python", "scorer.function=pkg.mod:fn", "scorer.options={delay_s = 1.5}"]).scorer
    assert isinstance(python, PythonScorerConfig) and python.options == {"delay_s": 1.5}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["scorer.device=cuda"], "scorer.path: Field required"),  # type defaults to hf, which needs a path
        (["scorer.type=hf"], "scorer.path: Field required"),
        (["scorer.type=hf", "scorer.path=/m", "scorer.batch_size=0"], "scorer.batch_size: Input should be greater"),
        (["scorer.type=hf", "scorer.path=/m", "scorer.transform=softmax"], "set label"),
        (["scorer.type=hf", "scorer.path=/m", "scorer.devise=cuda"], "scorer.devise: Extra inputs"),
        (["scorer.type=judge"], "scorer: Input tag 'judge'"),
        (["scorer.type=openai", "scorer.model=m", "scorer.base_url=127.0.0.1:8000"], "scorer.base_url: String should match"),
        (["scorer.type=openai", "scorer.model=m", "scorer.base_url=http://h/v1", "scorer.verdict.pattern=(a)(b)"],
         "scorer.verdict.pattern: the pattern needs exactly one capture group"),
        (["scorer.type=openai", "scorer.model=m", "scorer.base_url=http://h/v1", "scorer.max_attempts=0"],
         "scorer.max_attempts"),
        (["scorer.type=openai", "scorer.model=m", "scorer.base_url=http://h/v1", "scorer.prompt_template=rate it"],
         "put {completion} (or {steps}) in it"),
        (["scorer.type=python", "scorer.function=not a path"], "scorer.function: String should match"),
        (["scorer.type=python", "scorer.function=m:f", "scorer.max_items=5000"], "scorer.max_items"),
    ],
)
def test_bad_scorer_settings_name_their_key(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        load_config(None, overrides)
    assert message in str(raised.value)


def test_the_scorer_command_has_no_setting_flags() -> None:
    scorer = typer.main.get_command(app).commands["scorer"]  # type: ignore[attr-defined]
    assert {opt for param in scorer.params for opt in param.opts} == {
        "--orchestrator", "--token", "--config", "--set", "--scorer-id"}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ([], "no [scorer] section"),
        (["scorer.type=hf", "scorer.pathh=/m"], "scorer.pathh: Extra inputs"),
        (["scorer.type=openai", "scorer.base_url=http://h/v1", "scorer.model=m", "scorer.api_key_env=NO_SUCH_KEY_VAR"],
         "NO_SUCH_KEY_VAR"),
    ],
)
def test_the_scorer_command_stops_before_it_connects(overrides: list[str], message: str) -> None:
    argv = ["scorer", "--orchestrator", UNREACHABLE, "--token", "t"]
    for item in overrides:
        argv += ["--set", item]
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 2 and message in result.output


def double(items: list[ScoreItem], factor: float = 2.0) -> list[Verdict]:
    return [Verdict(len(item.completion) * factor) for item in items]


def one_short(items: list[ScoreItem]) -> list[Verdict]:
    return [Verdict(0.0) for _ in items[1:]]


def test_the_python_backend_calls_its_function_with_the_options() -> None:
    items = [ScoreItem(rollout_id=f"r{i}", prompt_id=0, prompt="p", completion="x" * i) for i in (1, 2)]
    backend = build_scorer_backend(
        PythonScorerConfig(function="tests.workers.test_scorer_config:double", options={"factor": 0.25})
    )
    assert [v.score for v in backend.score(items)] == [0.25, 0.5]
    short = PythonScoreBackend(PythonScorerConfig(function="tests.workers.test_scorer_config:one_short"))
    with pytest.raises(ValueError, match="1 verdicts for 2 items"):
        short.score(items)
    with pytest.raises(AttributeError):
        PythonScoreBackend(PythonScorerConfig(function="tests.workers.test_scorer_config:missing"))
