"""Run configuration: one pydantic model per role, built from shared sub-models.

A run is described by one TOML file (see configs/). `decentrl run` resolves it, writes the
result as JSON into the run directory, and hands that file to every role it starts; a role
started by hand on another machine reads the same file (or, for a worker, only needs the
orchestrator URL and a token). Every field is documented and constrained so that a bad file
fails at load time with the field's dotted name and what is allowed.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, model_validator


class Section(BaseModel):
    """Base for every config section: unknown keys are errors, so typos cannot pass silently."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class TinyModelConfig(Section):
    """A small Qwen2-style model built from a config, with a tokenizer made locally (no hub)."""

    type: Literal["tiny"] = "tiny"
    hidden_size: int = Field(128, ge=16, le=4096, description="Width of the residual stream.")
    num_layers: int = Field(2, ge=1, le=64, description="Number of transformer blocks.")
    num_heads: int = Field(4, ge=1, le=64, description="Attention heads; must divide hidden_size.")
    intermediate_size: int = Field(256, ge=16, description="Width of the MLP.")
    seed: int = Field(0, ge=0, description="Seed of the random initial weights (version 0).")

    @model_validator(mode="after")
    def _heads_divide(self) -> TinyModelConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_heads ({self.num_heads})"
            )
        return self


class PretrainedModelConfig(Section):
    """A Hugging Face causal LM directory (config.json, safetensors, tokenizer) on local disk."""

    type: Literal["pretrained"] = "pretrained"
    path: str = Field(description="Local directory of an HF causal LM with its tokenizer.")


def _keyed_by_type(default: str):  # noqa: ANN202 - a pydantic discriminator callable
    """Pick a union member by its `type` key, `default` when the file leaves it out."""

    def discriminate(value: object) -> str:
        if isinstance(value, dict):
            return str(value.get("type", default))
        return str(getattr(value, "type", default))

    return Discriminator(discriminate)


ModelConfig = Annotated[
    Annotated[TinyModelConfig, Tag("tiny")] | Annotated[PretrainedModelConfig, Tag("pretrained")],
    _keyed_by_type("tiny"),
]


class SortingTaskConfig(Section):
    """Sort a list of digits ascending; reward is the fraction of positions right (see tasks/)."""

    type: Literal["sorting"] = "sorting"
    num_digits: int = Field(4, ge=2, le=16, description="Digits per prompt.")
    num_prompts: int = Field(4096, ge=1, description="Size of the prompt pool (seeded).")
    seed: int = Field(0, ge=0, description="Seed of the prompt pool.")


class ArithmeticTaskConfig(Section):
    """Evaluate an integer expression ("12+7*3="); reward 1 for the exact value (see tasks/arithmetic.py)."""

    type: Literal["arithmetic"] = "arithmetic"
    path: str = Field(
        "arithmetic.jsonl", description="JSONL of {\"question\": ...}; a bare name is looked up in decentrl/tasks/data/."
    )
    seed: int = Field(0, ge=0, description="Seed of the prompt order.")


class CountdownTaskConfig(Section):
    """Reach a target with given numbers and + - * /; reward 1 for an exact solution (see tasks/countdown.py)."""

    type: Literal["countdown"] = "countdown"
    path: str = Field(
        "countdown.jsonl", description="JSONL of {\"numbers\": [...], \"target\": n}; bare names: decentrl/tasks/data/."
    )
    seed: int = Field(0, ge=0, description="Seed of the prompt order.")


class ImportTaskConfig(Section):
    """A user task: a class implementing decentrl.tasks.Task, constructed as Class(**options)."""

    type: Literal["import"] = "import"
    target: str = Field(pattern=r"^[\w.]+:\w+$", description="Import path 'package.module:Class'.")
    options: dict[str, object] = Field(default_factory=dict, description="Keyword arguments of the constructor.")
    seed: int = Field(0, ge=0, description="Seed of the prompt order.")


class GuessTaskConfig(Section):
    """Multi-turn: guess a secret number; after each guess the environment says higher or lower
    (see tasks/guess.py). Reward 1 - (guesses - 1) / max_turns once found, else 0."""

    type: Literal["guess"] = "guess"
    max_number: int = Field(99, ge=1, le=10**6, description="Secrets are drawn from 0..max_number.")
    max_turns: int = Field(8, ge=1, le=64, description="Guesses per episode at most.")
    num_prompts: int = Field(4096, ge=1, description="Size of the prompt pool (one secret each, seeded).")
    seed: int = Field(0, ge=0, description="Seed of the secrets and of the prompt order.")


class AnswerConfig(Section):
    """Where the answer sits in a completion, before the reward compares it (decentrl/tasks/rewards.py)."""

    format: Literal["raw", "tag", "boxed", "last_line"] = Field(
        "raw",
        description="raw: the whole completion (stripped); tag: the text inside the last <TAG>...</TAG>; "
        "boxed: the last \\boxed{...}; last_line: the last non-empty line. No answer found scores 0.",
    )
    tag: str = Field("answer", pattern=r"^[A-Za-z_][\w-]{0,31}$", description="The tag name for format = 'tag'.")


class ReasoningGymDatasetSpec(Section):
    """One reasoning-gym dataset of a weighted mix."""

    name: str = Field(min_length=1, description="A reasoning-gym dataset name (e.g. 'spell_backward').")
    weight: float = Field(1.0, gt=0, description="Relative share of prompts drawn from it.")
    options: dict[str, object] = Field(
        default_factory=dict, description="Its generator's config fields (e.g. {max_word_len = 4})."
    )


class ReasoningGymTaskConfig(Section):
    """Prompts from reasoning-gym procedural generators, scored by each dataset's own `score_answer`
    (decentrl/tasks/reasoning_gym.py; needs the `tasks` extra)."""

    type: Literal["reasoning_gym"] = "reasoning_gym"
    datasets: list[ReasoningGymDatasetSpec] = Field(
        min_length=1, max_length=64, description="One dataset, or a weighted mix of several."
    )
    size: int = Field(10000, ge=1, le=10_000_000, description="Prompts generated (seeded).")
    seed: int = Field(0, ge=0, description="Seed of the generators and of the prompt order; eval reseeds it.")
    answer: AnswerConfig = Field(default_factory=AnswerConfig, description="Answer extraction before scoring.")
    reward_timeout_s: float = Field(
        5.0, gt=0, le=600, description="A reward call running longer is stopped and scores 0 (counted, logged)."
    )


class DatasetTaskConfig(Section):
    """Prompts and answers from a local file (jsonl, json, parquet, csv, arrow) read with the `datasets`
    library, scored by a named reward (decentrl/tasks/dataset.py; needs the `tasks` extra)."""

    type: Literal["dataset"] = "dataset"
    path: str = Field(min_length=1, description="The data file (by extension: .jsonl/.json, .parquet, .csv, .arrow).")
    prompt_column: str = Field("prompt", min_length=1, description="Column of the prompt text (a string).")
    messages_column: str | None = Field(
        None, description="Column of chat messages ([{role, content}, ...]); when set, used instead of prompt_column."
    )
    answer_column: str = Field("answer", min_length=1, description="Column of the reference answer (string or number).")
    reward: str = Field(
        "exact",
        pattern=r"^(math|exact|regex|contains|[\w.]+:\w+)$",
        description="math (math-verify), exact, regex (the answer is a pattern the extracted answer must fully "
        "match), contains, or 'package.module:function' called as function(completion, answer) -> float in [0, 1].",
    )
    answer: AnswerConfig = Field(default_factory=AnswerConfig, description="Answer extraction before scoring.")
    eval_path: str | None = Field(None, description="A held-out file for `decentrl eval` (same columns).")
    eval_fraction: float = Field(
        0.0, ge=0, lt=1, description="Without eval_path: this share of rows (seeded) is held out of training for eval."
    )
    max_rows: int = Field(1_000_000, ge=1, description="Files with more rows are refused (bounds memory).")
    seed: int = Field(0, ge=0, description="Seed of the held-out choice and of the prompt order.")
    reward_timeout_s: float = Field(
        5.0, gt=0, le=600, description="A reward call running longer is stopped and scores 0 (counted, logged)."
    )



class PromptConfig(Section):
    """How a task's prompt becomes token ids; the orchestrator renders each prompt once and hands
    the ids to workers with the lease (decentrl/prompts.py)."""

    format: Literal["auto", "chat", "raw"] = Field(
        "auto",
        description="chat: render with the tokenizer's chat template; raw: the prompt text as is (base models); "
        "auto: chat when the tokenizer has a chat template.",
    )
    system: str | None = Field(None, max_length=100_000, description="A system message put before every prompt.")
    template_options: dict[str, object] = Field(
        default_factory=dict,
        description="Extra variables for the chat template, e.g. {enable_thinking = false} for Qwen3.",
    )


TaskConfig = Annotated[
    Annotated[SortingTaskConfig, Tag("sorting")]
    | Annotated[ArithmeticTaskConfig, Tag("arithmetic")]
    | Annotated[CountdownTaskConfig, Tag("countdown")]
    | Annotated[GuessTaskConfig, Tag("guess")]
    | Annotated[ImportTaskConfig, Tag("import")]
    | Annotated[ReasoningGymTaskConfig, Tag("reasoning_gym")]
    | Annotated[DatasetTaskConfig, Tag("dataset")],
    _keyed_by_type("sorting"),
]


class StoreConfig(Section):
    """Where versioned checkpoints live. Any fsspec URL; empty means `<run_dir>/checkpoints`.

    For s3:// the endpoint, region and credentials below override the usual AWS environment
    (AWS_ENDPOINT_URL, AWS_REGION, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_PROFILE), which
    applies wherever they are left unset. See docs/store.md.
    """

    url: str = Field("", description="fsspec URL (file:///dir, s3://bucket/prefix, ...); '' = run dir.")
    keep_last: int = Field(
        8, ge=1, description="Versions kept by retention; raised to max_staleness + 2 if smaller."
    )
    retention_grace_s: float = Field(
        300.0, ge=0, description="A version is deleted only this long after a newer one was published "
        "(a worker may still be pulling it); make it longer than the slowest worker's pull.",
    )
    storage_options: dict[str, object] = Field(
        default_factory=dict, description="Extra fsspec filesystem options, e.g. {anon = true} for s3fs."
    )
    endpoint: str | None = Field(None, description="S3-compatible endpoint URL (MinIO, R2, ...); s3:// only.")
    region: str | None = Field(None, description="S3 region; s3:// only.")
    access_key_id: str | None = Field(
        None, description="S3 access key; s3:// only. Prefer the environment: the resolved config is written to the run dir."
    )
    secret_access_key: str | None = Field(None, description="S3 secret key, set together with access_key_id.")
    shard_size_mb: int = Field(
        128, ge=1, description="Largest safetensors shard; more shards upload and download in parallel."
    )
    upload_concurrency: int = Field(4, ge=1, le=64, description="Files uploaded at once by a publish.")
    download_concurrency: int = Field(4, ge=1, le=64, description="Files downloaded at once by a pull.")
    link_local: bool = Field(
        True, description="Local store on the cache's filesystem: pulls hard-link the verified files into "
        "the cache instead of copying them (zero copy). Off, or a public_key set: pulls always copy.",
    )
    cache_max_gb: float | None = Field(
        20.0, gt=0, description="Cap on a local pull cache; the oldest versions are evicted. None = no cap."
    )
    signing_key: str = Field(
        "", description="Trainer: ed25519 private key file that signs every manifest ('' = unsigned)."
    )
    public_key: str = Field(
        "", description="Readers: ed25519 public key file; unsigned or wrongly signed versions are refused."
    )

    @model_validator(mode="after")
    def _s3_fields(self) -> StoreConfig:
        s3_only = {"endpoint": self.endpoint, "region": self.region, "access_key_id": self.access_key_id}
        used = [name for name, value in s3_only.items() if value is not None]
        if used and not self.url.startswith("s3://"):
            raise ValueError(f"{', '.join(used)} apply to s3:// URLs only (url is {self.url!r})")
        if (self.access_key_id is None) != (self.secret_access_key is None):
            raise ValueError("set access_key_id and secret_access_key together, or neither (then the AWS environment is used)")
        return self

    def fsspec_options(self) -> dict[str, object]:
        """storage_options for fsspec: `storage_options` plus the s3 fields that are set."""
        options = dict(self.storage_options)
        client_kwargs = dict(options.get("client_kwargs") or {})  # type: ignore[call-overload]
        if self.endpoint is not None:
            client_kwargs["endpoint_url"] = self.endpoint
        if self.region is not None:
            client_kwargs["region_name"] = self.region
        if client_kwargs:
            options["client_kwargs"] = client_kwargs
        if self.access_key_id is not None:
            options.update(key=self.access_key_id, secret=self.secret_access_key)
        return options


class SamplingConfig(Section):
    """How workers sample; sent to workers with every lease so all of them sample alike."""

    temperature: float = Field(1.0, gt=0.0, le=10.0, description="Softmax temperature.")
    max_tokens: int = Field(8, ge=1, le=131072, description="Most completion tokens per sample.")
    top_k: int = Field(0, ge=0, description="Keep only the k most likely tokens at each step; 0 = no top-k.")
    top_p: float = Field(
        1.0, gt=0.0, le=1.0, description="Keep the smallest set of tokens whose probability reaches top_p; 1.0 = off."
    )
    stop: list[str] = Field(
        default_factory=list, max_length=16,
        description="Stop strings: a completion ends with the token that completes one (that token is kept).",
    )


class VerificationConfig(Section):
    """Checks of untrusted workers' rollouts (docs/security.md); off for a run of trusted workers.

    On: finish_reason must agree with the tokens, a replayed rollout is rejected, and a share of
    rollouts (all of a new or flagged worker's) has its logprobs recomputed under the claimed
    version. Groups holding a checked rollout wait for the check before the trainer sees them.
    A rejected check is a strike against the token; at `max_strikes` the token is revoked.
    """

    enabled: bool = Field(False, description="Run the checks below (claimed rewards are never used either way).")
    spot_check_fraction: float = Field(
        0.03, ge=0.0, le=1.0,
        description="Share of an established, unflagged worker's rollouts whose logprobs are recomputed "
        "(docs/security.md: what a fraction buys in detection and costs in verifier compute).",
    )
    new_worker_checks: int = Field(
        64, ge=0, description="A token's first N rollouts are all checked (a new worker earns trust first)."
    )
    tolerance: float = Field(
        0.01, gt=0.0,
        description="Largest accepted |claimed - recomputed| logprob of any one token. Honest fp32 CPU workers "
        "measured at most 4.8e-7 (docs/security.md); the default leaves room for other CPUs and BLAS "
        "libraries. Measure and raise it for bf16/GPU workers (vLLM).",
    )
    max_strikes: int = Field(3, ge=1, description="Strikes (rejections for cheating) after which a token is revoked.")
    torch_threads: int = Field(1, ge=1, le=256, description="CPU threads of the verifier's forward passes.")
    models_cached: int = Field(2, ge=1, le=16, description="Policy versions kept loaded by the verifier at once.")
    check_wait_s: float = Field(
        0.5, ge=0.0, le=60.0,
        description="A held-back group waits up to this long for others to be checked with it in one forward "
        "(each check has a fixed cost), but never once the trainer's next batch needs it; 0 = check at once.",
    )
    check_batch_rollouts: int = Field(
        128, ge=1, le=65536,
        description="Most rollouts recomputed in one forward (a group is never split); also starts a check "
        "before check_wait_s. Lower it for long sequences or large vocabularies (memory).",
    )


class OrchestratorConfig(Section):
    """The central HTTP service: leases, ingest, rewards, groups, batches (see docs/api.md)."""

    host: str = Field("127.0.0.1", description="Interface to bind; 0.0.0.0 to accept remote workers.")
    port: int = Field(8740, ge=0, le=65535, description="TCP port; 0 picks a free one.")
    lease_timeout_s: float = Field(
        30.0, gt=0, description="A leased prompt not answered within this is leased again."
    )
    max_request_bytes: int = Field(
        16 * 1024 * 1024, ge=1024, description="Largest accepted request body (after gzip decompression): 413 above."
    )
    batch_wait_s: float = Field(
        20.0, gt=0, description="How long one trainer batch request waits before answering 204."
    )
    lease_wait_s: float = Field(
        2.0, ge=0, le=30,
        description="How long a lease request with nothing to grant (the staleness budget or the buffer is "
        "full) waits for groups to free up before answering empty; 0 = answer at once with retry_after_s.",
    )
    journal: bool = Field(
        True,
        description="Journal every acknowledged rollout, lease and version in <run_dir>/journal.sqlite "
        "(SQLite, WAL) before answering, and recover from it on restart.",
    )
    journal_sync: Literal["full", "normal"] = Field(
        "full",
        description="full: fsync each commit (survives power loss); normal: survives a killed "
        "orchestrator process, not a crashed machine.",
    )
    max_buffer_groups: int = Field(
        4096, ge=1, description="Depth bound: complete groups waiting for the trainer plus open leases."
    )
    max_inflight_requests: int = Field(
        64, ge=1, description="Rollout posts processed at once; more get 503 with Retry-After (bounds memory)."
    )
    rate_limit_per_s: float = Field(
        1000.0, ge=0,
        description="Requests per second per token (token bucket; a token may serve many workers); 0 = no limit. "
        "Over it: 429 with Retry-After.",
    )
    rate_limit_burst: int = Field(2000, ge=1, description="Bucket size: requests a token may make at once.")
    dedupe_window_s: float = Field(
        900.0,
        gt=0,
        description="How long a closed lease and its rollout ids are remembered: a resend within it is "
        "answered as a duplicate; later, as a rejection of its (forgotten) lease.",
    )
    batches_kept: int = Field(
        4, ge=1, description="Served batches kept, so a trainer resending a lost request gets the same batch."
    )
    metrics_public: bool = Field(
        False, description="Serve /metrics without a token (default: trainer or admin token)."
    )
    verification: VerificationConfig = Field(
        default_factory=VerificationConfig, description="Checks of untrusted workers (docs/security.md)."
    )


class WorkerConfig(Section):
    """An inference worker: pulls versions, generates, posts rollouts."""

    backend: Literal["hf", "vllm", "openai"] = Field(
        "hf", description="Inference backend: transformers, in-process vLLM, or an OpenAI-compatible server."
    )
    swap_deadline_s: float = Field(
        5.0, ge=0, description="Soft pause: in-flight generation may finish for this long before it continues "
        "under the new weights as a partial rollout.",
    )
    groups_per_request: int = Field(
        4, ge=1, le=1024, description="Prompts (groups) leased and generated together."
    )
    device: str = Field("cpu", description="torch device for the hf backend.")
    torch_threads: int = Field(1, ge=1, description="Intra-op CPU threads.")
    concurrency: int = Field(
        1, ge=1, le=256, description="Lease slots in flight per worker (concurrent requests to the backend)."
    )
    max_batch_rows: int = Field(
        256, ge=1, description="Most rows (samples) of all slots generated together in one backend call; bounds "
        "the memory of a batched decode.",
    )
    simulated_latency_median_s: float = Field(
        0.0, ge=0, description="Benchmarks only: median of an injected log-normal delay per request (0 = off)."
    )
    simulated_latency_sigma: float = Field(1.0, ge=0, le=4, description="Shape of the injected log-normal delay.")
    slowdowns: list[float] = Field(
        default_factory=list,
        description="Benchmarks only: per local worker i, a factor >= 1 on its generation time (missing = 1).",
    )

    @model_validator(mode="after")
    def _slowdowns_at_least_one(self) -> WorkerConfig:
        if any(factor < 1 for factor in self.slowdowns):
            raise ValueError(f"slowdowns must all be >= 1 (got {self.slowdowns})")
        return self


class PolicyLossBase(Section):
    """PPO clipping shared by every loss normalization (clip-higher: eps_high > eps_low)."""

    eps_low: float = Field(
        0.2, gt=0, le=1, description="PPO clip: a token with negative advantage and ratio < 1 - eps_low gets no gradient."
    )
    eps_high: float = Field(
        0.28, gt=0, description="PPO clip: a token with positive advantage and ratio > 1 + eps_high gets no gradient."
    )


class GRPOLossConfig(PolicyLossBase):
    """GRPO: each sample's token terms averaged over its own length, then over samples."""

    type: Literal["grpo"] = "grpo"


class TokenLossConfig(PolicyLossBase):
    """Token-level (DAPO): one mean over every completion token of the batch."""

    type: Literal["token"] = "token"


class DrGRPOLossConfig(PolicyLossBase):
    """Dr.GRPO: token terms summed and divided by a constant, samples * sampling.max_tokens."""

    type: Literal["dr_grpo"] = "dr_grpo"


LossConfig = Annotated[
    Annotated[GRPOLossConfig, Tag("grpo")]
    | Annotated[TokenLossConfig, Tag("token")]
    | Annotated[DrGRPOLossConfig, Tag("dr_grpo")],
    _keyed_by_type("grpo"),
]


class TISConfig(Section):
    """Truncated importance sampling: weight min(pi_trainer / pi_worker, cap) on every token."""

    type: Literal["tis"] = "tis"
    cap: float = Field(2.0, ge=1.0, description="Truncation cap C on the per-token ratio.")


class IcePopConfig(Section):
    """IcePop: tokens whose ratio pi_trainer / pi_worker leaves [low, high] get no gradient."""

    type: Literal["icepop"] = "icepop"
    low: float = Field(0.5, gt=0, le=1, description="Tokens with a ratio below this are masked.")
    high: float = Field(5.0, ge=1, description="Tokens with a ratio above this are masked.")


class SeqMaskConfig(Section):
    """Sequence masking: a sample whose geometric-mean ratio leaves [low, high] is dropped whole."""

    type: Literal["seq_mask"] = "seq_mask"
    low: float = Field(0.8, gt=0, le=1, description="Samples with a geometric-mean ratio below this are masked.")
    high: float = Field(1.25, ge=1, description="Samples with a geometric-mean ratio above this are masked.")
    cap: float = Field(2.0, ge=1.0, description="Truncated IS cap on the tokens of the samples kept.")


OffPolicyConfig = Annotated[
    Annotated[TISConfig, Tag("tis")] | Annotated[IcePopConfig, Tag("icepop")] | Annotated[SeqMaskConfig, Tag("seq_mask")],
    _keyed_by_type("tis"),
]


class AdvantageConfig(Section):
    """Group-relative advantages: the orchestrator centers each group's rewards, the trainer filters."""

    normalize_std: bool = Field(
        False, description="Divide each group's centered rewards by the group's std (GRPO); Dr.GRPO leaves it off."
    )
    drop_zero_variance: bool = Field(
        False,
        description="Train only on groups whose rewards differ: a group of equal rewards has no policy-gradient "
        "signal, only KL/entropy terms and a share of the normalization.",
    )


class LoRAConfig(Section):
    """Train a LoRA adapter (peft) instead of every weight: version 0 is the full base model,
    every later version only the adapter (docs/trainer.md#lora)."""

    rank: int = Field(16, ge=1, le=1024, description="Rank r of each adapter (A: r x in, B: out x r).")
    alpha: float = Field(32.0, gt=0, description="Scale of the adapter's output: alpha / rank.")
    dropout: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Dropout on the adapter's input while training. Keep 0 for RL: with dropout the trainer's "
        "logprobs are noisy samples, not the policy the workers sampled from.",
    )
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        min_length=1,
        description="Names of the Linear modules that get an adapter (e.g. add gate_proj, up_proj, down_proj for the MLP).",
    )


class TrainerConfig(Section):
    """The FSDP2 trainer: pulls batches, steps, publishes the next version."""

    steps: int = Field(60, ge=1, description="Optimizer steps to run; version N is published after step N.")
    groups_per_step: int = Field(32, ge=1, description="Prompt groups in one batch.")
    lr: float = Field(1e-3, gt=0, lt=1, description="AdamW learning rate.")
    lr_warmup_steps: int = Field(0, ge=0, description="Linear warmup of the learning rate over these steps; 0 = none.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    loss: LossConfig = Field(default_factory=GRPOLossConfig, description="Normalization and PPO clipping.")
    off_policy: OffPolicyConfig = Field(
        default_factory=TISConfig, description="Correction against the workers' sampling logprobs."
    )
    advantages: AdvantageConfig = Field(default_factory=AdvantageConfig)
    kl_coef: float = Field(
        0.0, ge=0, description="Weight of the k3 KL to the initial model (version 0); 0 = no reference model loaded."
    )
    entropy_coef: float = Field(0.0, ge=0, description="Weight of the entropy bonus (subtracted from the loss).")
    micro_batch_tokens: int = Field(
        16384,
        ge=2,
        description="Padded tokens (rows x longest row) per forward/backward; bounds activation memory. "
        "Gradients accumulate over micro-batches; every sample (prompt + completion) must fit in one.",
    )
    activation_checkpointing: bool = Field(
        False, description="Recompute each transformer block's activations in backward (less memory, ~30% more compute)."
    )
    mixed_precision: Literal["fp32", "bf16"] = Field(
        "fp32", description="bf16: FSDP2 computes in bf16, reduces gradients and keeps weights in fp32 (GPU)."
    )
    checkpoint_every: int = Field(
        25, ge=1, description="Steps between resumable checkpoints under <run_dir>/trainer; the last step saves one too."
    )
    checkpoint_keep: int = Field(2, ge=1, description="Resumable checkpoints kept (older ones are deleted).")
    lora: LoRAConfig | None = Field(
        None, description="Present ([trainer.lora]): train a LoRA adapter on frozen base weights and publish only it."
    )
    seed: int = Field(0, ge=0, description="Seed of the trainer's RNG.")
    torch_threads: int = Field(1, ge=1, description="Intra-op CPU threads per rank.")

    @model_validator(mode="after")
    def _consistent(self) -> TrainerConfig:
        if self.loss.type == "dr_grpo" and self.advantages.normalize_std:
            raise ValueError(
                "trainer.loss.type = 'dr_grpo' removes the std normalization of advantages: "
                "set trainer.advantages.normalize_std = false, or use trainer.loss.type = 'grpo'"
            )
        if self.lr_warmup_steps >= self.steps:
            raise ValueError(
                f"trainer.lr_warmup_steps ({self.lr_warmup_steps}) must be smaller than trainer.steps ({self.steps})"
            )
        return self


class RunConfig(Section):
    """Everything one run needs; each role reads its own section plus the shared ones."""

    run_name: str = Field("demo", pattern=r"^[A-Za-z0-9._-]{1,64}$", description="Run id.")
    max_staleness: int = Field(
        1, ge=0, le=1024, description="Rollouts from version v train step s iff s - v <= this; 0 = synchronous."
    )
    group_size: int = Field(8, ge=2, le=1024, description="Samples per prompt (GRPO group).")
    model: ModelConfig = Field(default_factory=TinyModelConfig)
    task: TaskConfig = Field(default_factory=SortingTaskConfig)
    prompt: PromptConfig = Field(default_factory=PromptConfig, description="Chat template or raw prompts.")
    store: StoreConfig = Field(default_factory=StoreConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    orchestrator: OrchestratorConfig = Field(default_factory=OrchestratorConfig)
    worker: WorkerConfig = Field(default_factory=WorkerConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    num_workers: int = Field(2, ge=1, le=64, description="Workers `decentrl run` starts locally.")
    trainer_ranks: int = Field(2, ge=1, le=64, description="Trainer processes `decentrl run` starts.")
    tolerate_worker_exits: bool = Field(
        False, description="`decentrl run` keeps going when a worker dies (as long as one is left)."
    )

    @model_validator(mode="after")
    def _batch_divides(self) -> RunConfig:
        samples = self.trainer.groups_per_step * self.group_size
        if samples % self.trainer_ranks:
            raise ValueError(
                f"trainer.groups_per_step * group_size ({samples}) must be divisible by "
                f"trainer_ranks ({self.trainer_ranks}) so every rank trains on the same number of samples"
            )
        return self

    def with_store_url(self, url: str) -> RunConfig:
        return self.model_copy(update={"store": self.store.model_copy(update={"url": url})})


UNION_TAGS = {"tiny", "pretrained", "sorting", "arithmetic", "countdown", "import", "guess", "reasoning_gym", "dataset", "grpo", "token", "dr_grpo", "tis", "icepop", "seq_mask"}


class ConfigError(Exception):
    """A config file that cannot be used; the message names the file, the field and what is allowed."""


def _format_error(source: str, error: ValidationError) -> str:
    lines = [f"{source}: invalid config"]
    for item in error.errors():
        # Drop union tags ("model.tiny.hidden_size" -> "model.hidden_size"): they are not in the file.
        parts = [str(part) for part in item["loc"] if str(part) not in UNION_TAGS]
        field = ".".join(parts) or "(top level)"
        got = f" (got {item['input']!r})" if item["type"] != "missing" and "input" in item else ""
        lines.append(f"  {field}: {item['msg']}{got}")
    return "\n".join(lines)


def parse_config(data: dict[str, object], source: str = "config") -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigError(_format_error(source, error)) from None


def load_config(path: str) -> RunConfig:
    """Read a TOML (or resolved JSON) run config; raises ConfigError with a fixable message."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"{path}: no such config file")
    try:
        text = file.read_text(encoding="utf-8")
        data = json.loads(text) if file.suffix == ".json" else tomllib.loads(text)
    except (UnicodeDecodeError, tomllib.TOMLDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(f"{path}: not valid {file.suffix.lstrip('.').upper() or 'TOML'}: {error}") from None
    return parse_config(data, source=path)
