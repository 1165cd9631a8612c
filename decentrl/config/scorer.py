"""`[scorer]`: how a scorer process scores samples (workers/scorers/ builds its backend from it;
docs/rewards.md, "Scorer backends").

Read by `decentrl scorer` only. What the run decides (the score range, which samples need a
model score, steps, what a failed parse turns into) comes from the orchestrator with every score
lease, so this section holds the scorer's own settings: its backend, keyed on `type` (a reward
model directory, an OpenAI-compatible judge, a Python function, or a distillation teacher), and
how much it leases at once.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from decentrl.config.base import Section, keyed_union

PLACEHOLDERS = ("prompt", "completion", "steps")  # what a judge prompt template may name
ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"


class ScorerBase(Section):
    """What every scorer backend shares: the lease size, the leases kept in hand, and the wait when nothing is due."""

    max_items: int = Field(
        16, ge=1, le=1024, description="Samples leased (and scored together) at once; a lease is renewed while "
        "they are scored, so this bounds the work lost with a dead scorer, not the time a batch may take."
    )
    leases_ahead: int = Field(
        1, ge=0, le=8, description="Leases kept in hand beyond the one being scored (asked for while it is scored, "
        "renewed while they wait, yielding to idle scorers: docs/rewards.md), so the next samples are there when "
        "the backend is free; 0: ask only when idle."
    )
    min_wait_s: float = Field(
        0.5, gt=0, le=60, description="Least wait before asking again after an empty lease (the orchestrator's "
        "retry_after_s, when longer, wins)."
    )


class HFScorerConfig(ScorerBase):
    """A reward model: an AutoModelForSequenceClassification directory (and its tokenizer)."""

    type: Literal["hf"] = "hf"
    path: str = Field(min_length=1, description="The model directory (config.json, weights, tokenizer files).")
    device: str = Field("cpu", min_length=1, description="torch device, e.g. cpu, cuda, cuda:1.")
    gpu_memory: float | None = Field(
        None, gt=0, le=1, description="Share of its GPU's memory this scorer may take on CUDA "
        "(torch.cuda.set_per_process_memory_fraction); None: no limit. `decentrl run` sets it from "
        "[placement] scorers.memory.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="The dtype the model computes in. auto: its weights' own dtype where the device computes it "
        "natively, else float32 (decentrl/model/devices.py compute_dtype)."
    )
    batch_size: int = Field(8, ge=1, le=1024, description="Texts per forward pass (whole samples and step prefixes).")
    max_length: int = Field(
        2048, ge=8, le=2**20, description="Tokens per text at most; longer texts are cut on `truncation_side`."
    )
    truncation_side: Literal["left", "right"] = Field(
        "left", description="Where a too long text is cut: left keeps the end of the completion, which the "
        "classifier reads its score from."
    )
    input: Literal["chat", "text"] = Field(
        "chat", description="chat: the tokenizer's chat template over the prompt's messages (or the prompt as one "
        "user turn) and the completion as the assistant's turn; text: prompt + completion as plain text."
    )
    label: int | None = Field(
        None, ge=0, description="The output read as the score; required when the model has several labels "
        "(num_labels > 1), left out when it has one."
    )
    transform: Literal["logit", "sigmoid", "softmax"] = Field(
        "logit", description="The score: the raw logit, its sigmoid, or the softmax probability of `label`."
    )
    torch_threads: int = Field(1, ge=1, le=256, description="Intra-op CPU threads.")

    @model_validator(mode="after")
    def _softmax_has_label(self) -> HFScorerConfig:
        if self.transform == "softmax" and self.label is None:
            raise ValueError("transform = 'softmax' is the probability of one label: set label (e.g. label = 1)")
        return self


class RegexVerdictConfig(Section):
    """The judge's verdict is the number a regular expression captures (its last match in the reply)."""

    type: Literal["regex"] = "regex"
    pattern: str = Field(
        r"(?i)score\s*[:=]\s*([-+]?\d+(?:\.\d+)?)", min_length=1, max_length=1000,
        description="A Python regex with exactly one capture group holding the number.",
    )
    scale: float = Field(
        1.0, gt=0, description="The number is multiplied by this (e.g. 0.1 for a judge rating 0..10 in a 0..1 run)."
    )

    @field_validator("pattern")
    @classmethod
    def _one_group(cls, pattern: str) -> str:
        try:
            groups = re.compile(pattern).groups
        except re.error as exc:
            raise ValueError(f"not a regular expression: {exc}") from None
        if groups != 1:
            raise ValueError(f"the pattern needs exactly one capture group around the number (it has {groups})")
        return pattern


class JsonVerdictConfig(Section):
    """The judge answers with a JSON object (the outermost {...} of its reply); the verdict is a field of it."""

    type: Literal["json"] = "json"
    field: str = Field("score", pattern=r"^[\w.-]{1,200}$", description="The score's key; dots walk nested objects.")
    steps_field: str | None = Field(
        None, pattern=r"^[\w.-]{1,200}$", description="Process rewards: the key of a list with one score per step "
        "(asked for only when a sample has steps); None: the judge gives no step scores."
    )
    scale: float = Field(1.0, gt=0, description="Scores (and step scores) are multiplied by this.")


VerdictConfig = keyed_union(RegexVerdictConfig, JsonVerdictConfig)

DEFAULT_JUDGE_PROMPT = """You are grading an answer to a task.

Task:
{prompt}

Answer:
{completion}

Judge whether the answer is correct and complete. Reply with one line "Score: X", where X is a
number from 0 (wrong) to 1 (fully correct)."""


class OpenAIEndpoint(Section):
    """An OpenAI-compatible server: where it is, the model asked for, and the key, for the judge
    (BASE_URL/chat/completions) and the distillation teacher (BASE_URL/completions)."""

    base_url: str = Field(
        pattern=r"^https?://\S+$", description="The API's base URL, up to /v1: http://127.0.0.1:8000/v1, "
        "https://api.openai.com/v1; a judge's requests go to BASE_URL/chat/completions, a teacher's to "
        "BASE_URL/completions (and BASE_URL/models once at start-up)."
    )
    model: str = Field(min_length=1, max_length=200, description="The model's name at that server.")
    api_key_env: str | None = Field(
        None, pattern=ENV_NAME, description="Name of the environment variable holding the API key (sent as a bearer "
        "token, never logged); None: no Authorization header (a local server)."
    )


class OpenAIScorerConfig(ScorerBase, OpenAIEndpoint):
    """An LLM judge: any OpenAI-compatible chat completions endpoint, a prompt template and a verdict parser."""

    type: Literal["openai"] = "openai"
    system_prompt: str = Field("", max_length=100_000, description="The system message; empty: none is sent.")
    prompt_template: str = Field(
        DEFAULT_JUDGE_PROMPT, min_length=1, max_length=100_000,
        description="The user message: {prompt}, {completion} and {steps} (the steps numbered one a line) are "
        "replaced by the sample's, and {completion} or {steps} must be there; other braces are kept as written.",
    )
    verdict: VerdictConfig = Field(
        default_factory=RegexVerdictConfig, description="How the score is read from the reply ([scorer.verdict] type = "
        "'regex' or 'json')."
    )
    temperature: float = Field(0.0, ge=0, le=2, description="Sampling temperature of the judge.")
    max_tokens: int = Field(512, ge=1, le=1_000_000, description="Most tokens the judge may reply with.")
    max_attempts: int = Field(
        3, ge=1, le=20, description="Tries per sample: a reply that does not parse, a 5xx/429 answer, a timeout or a "
        "dropped connection is asked again. Unparsed after all: posted as a parse failure (the run's "
        "on_parse_failure decides); unreachable after all: left to the lease's expiry and leased again."
    )
    backoff_s: float = Field(1.0, ge=0, le=600, description="Wait before the first retry; doubles each retry (with jitter).")
    timeout_s: float = Field(120.0, gt=0, le=3600, description="One request's time limit.")
    concurrency: int = Field(8, ge=1, le=256, description="Requests to the judge in flight at once.")

    @field_validator("prompt_template")
    @classmethod
    def _names_completion(cls, template: str) -> str:
        if "{completion}" not in template and "{steps}" not in template:
            raise ValueError("the judge prompt template must show the judge the sample: put {completion} (or "
                             "{steps}) in it (placeholders: {prompt}, {completion}, {steps})")
        return template


class PythonScorerConfig(ScorerBase):
    """A Python function scores: `fn(items: list[ScoreItem], **options) -> list[Verdict]` (workers/scorers/)."""

    type: Literal["python"] = "python"
    function: str = Field(pattern=r"^[\w.]+:\w+$", description="Import path 'package.module:function'.")
    options: dict[str, object] = Field(default_factory=dict, description="Keyword arguments passed to the function.")


class TeacherServerConfig(OpenAIEndpoint):
    """A distillation teacher behind an OpenAI-compatible completions server that returns the log-probs
    of the prompt's own tokens (vLLM: `prompt_logprobs`; the classic form: `echo` with `logprobs`).
    Each sample is one POST BASE_URL/completions whose prompt is its token ids (prompt, then
    completion); the answer's log-probs at the completion's positions are the teacher's."""

    logprobs: Literal["prompt_logprobs", "echo"] = Field(
        "prompt_logprobs", description="How the log-probs are asked for and read: prompt_logprobs (vLLM's extension: "
        "`prompt_logprobs: 0`, read from choices[0].prompt_logprobs, each position's token id checked against the id "
        "sent); echo (`echo: true, logprobs: 0`, read from choices[0].logprobs.token_logprobs, positions only)."
    )
    max_attempts: int = Field(
        3, ge=1, le=20, description="Tries per sample when the server does not answer (a timeout, a dropped "
        "connection, 408, 429, 5xx); unanswered after all: left to the lease's expiry and leased again."
    )
    backoff_s: float = Field(1.0, ge=0, le=600, description="Wait before the first retry; doubles each retry (with jitter).")
    timeout_s: float = Field(120.0, gt=0, le=3600, description="One request's time limit.")
    concurrency: int = Field(8, ge=1, le=256, description="Requests to the server in flight at once.")


class TeacherScorerConfig(ScorerBase):
    """On-policy distillation's teacher (workers/scorers/teacher.py): a causal LM with the run's
    tokenizer scores the student's own samples token by token - a model directory (`path`), or a
    server (`[scorer.server]`, workers/scorers/teacher_server.py). For each leased sample it
    posts the teacher's log-prob of every completion token given the prompt's and the earlier
    tokens' ids (`[orchestrator.advantages.distill]` turns them into advantages) and, as the
    sample's score, exp(mean of those log-probs): the teacher's per-token likelihood, in (0, 1]."""

    type: Literal["teacher"] = "teacher"
    path: str | None = Field(
        None, min_length=1, description="The teacher's directory (config.json, weights, tokenizer files): what `decentrl "
        "model init/import` writes, or a version of a run's store; its tokenizer must be the run's (checked at start-up). "
        "Set this or [scorer.server], not both."
    )
    server: TeacherServerConfig | None = Field(
        None, description="The teacher behind an OpenAI-compatible server instead of a directory: [scorer.server] "
        "base_url, model, ... (its tokenizer is the operator's to match: docs/rewards_backends.md)."
    )
    device: str = Field("cpu", min_length=1, description="torch device, e.g. cpu, cuda, cuda:1 (a directory's teacher).")
    gpu_memory: float | None = Field(
        None, gt=0, le=1, description="Share of its GPU's memory this scorer may take on CUDA; None: no limit. "
        "`decentrl run` sets it from [placement] scorers.memory.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="The dtype the model computes in. auto: its weights' own dtype where the device computes it "
        "natively, else float32 (decentrl/model/devices.py compute_dtype)."
    )
    batch_size: int = Field(16, ge=1, le=1024, description="Samples per forward pass (padded to the longest).")
    max_length: int = Field(
        32768, ge=2, le=2**20, description="Most prompt + completion tokens of one sample; a longer one is posted as "
        "a failure (the run's on_parse_failure decides), never cut: every completion token needs its log-prob."
    )
    temperature: float = Field(
        1.0, gt=0, le=10, description="The teacher's logits are divided by this before the log-softmax; 1.0: the "
        "teacher's own distribution (what on-policy distillation matches). A server's log-probs are its model's "
        "own: with [scorer.server] only 1.0 is accepted."
    )
    torch_threads: int = Field(1, ge=1, le=256, description="Intra-op CPU threads.")

    @model_validator(mode="after")
    def _one_teacher(self) -> TeacherScorerConfig:
        if self.path is None and self.server is None:
            raise ValueError("a teacher scorer needs its model: set [scorer] path (a model directory) or [scorer.server] "
                             "(base_url and model of an OpenAI-compatible server)")
        if self.path is not None and self.server is not None:
            raise ValueError("[scorer] path and [scorer.server] both name a teacher: set one of them")
        if self.server is not None and self.temperature != 1.0:
            raise ValueError("a server's prompt log-probs are its model's own (temperature 1): [scorer] temperature "
                             f"= {self.temperature} applies to a directory's teacher only; drop it or use path")
        return self


ScorerConfig = keyed_union(HFScorerConfig, OpenAIScorerConfig, PythonScorerConfig, TeacherScorerConfig)
