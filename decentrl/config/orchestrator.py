"""`[orchestrator]` and `[sampling]`: the central service's settings (orchestrator/ reads them).

`[sampling]` is here because the orchestrator sends it to workers with every lease and rejects
rollouts sampled otherwise. `[orchestrator.advantages]` is here because the orchestrator computes
advantages; the trainer receives them ready.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, model_validator

from decentrl.config.base import Section, keyed_union
from decentrl.config.distill import DistillConfig
from decentrl.config.roles import RolesConfig


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
        description="Versions published in fp32: largest accepted |claimed - recomputed| logprob of any one token. "
        "Honest fp32 CPU workers measured at most 4.8e-7 (docs/security.md); the default leaves room for other CPUs "
        "and BLAS libraries. Measure and raise it for GPU workers (vLLM).",
    )
    half_tolerance: float = Field(
        1.5, gt=0.0, le=20.0,
        description="Versions published in bf16 or fp16: largest accepted |claimed - recomputed| logprob of any one "
        "token. Honest workers of a 30-layer model round differently from the verifier by up to 0.8 at a token "
        "(docs/store.md); this bound catches a large edit of one token, half_mean_tolerance the rest.",
    )
    half_mean_tolerance: float = Field(
        0.15, gt=0.0, le=20.0,
        description="Versions published in bf16 or fp16: largest accepted mean |claimed - recomputed| logprob over the "
        "tokens a rollout sampled, at least 16 (a shorter completion's missing tokens count as 0). Honest workers of "
        "a 30-layer model measured at most 0.074 (docs/store.md).",
    )
    max_strikes: int = Field(3, ge=1, description="Strikes (rejections for cheating) after which a token is revoked.")
    torch_threads: int = Field(1, ge=1, le=256, description="CPU threads of the verifier's forward passes.")
    compute_dtype: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="The verifier's compute dtype. auto: the versions' published dtype where this CPU computes "
        "it natively, else fp32 from the same weights. The bounds follow the published dtype either way (bf16 "
        "versions: half_tolerance, which holds for workers computing in fp32 or bf16: docs/store.md).",
    )
    models_cached: int = Field(2, ge=1, le=16, description="Policy versions kept loaded by the verifier at once.")
    check_wait_s: float = Field(
        0.5, ge=0.0, le=60.0,
        description="A pending group waits up to this long for others to be checked with it in one forward "
        "(each check has a fixed cost), but never once the trainer's next batch needs it; 0 = check at once.",
    )
    check_batch_rollouts: int = Field(
        128, ge=1, le=65536,
        description="Most rollouts recomputed in one forward (a group is never split); also starts a check "
        "before check_wait_s. Lower it for long sequences or large vocabularies (memory).",
    )

    @model_validator(mode="after")
    def _mean_can_bind(self) -> VerificationConfig:
        if self.half_mean_tolerance > self.half_tolerance:
            raise ValueError(
                f"orchestrator.verification.half_mean_tolerance ({self.half_mean_tolerance}) is above half_tolerance "
                f"({self.half_tolerance}): a mean never exceeds the largest difference it averages, so it could not bind; "
                "lower half_mean_tolerance or raise half_tolerance"
            )
        return self


class DelimiterStepsConfig(Section):
    """Steps of a completion are the text between runs of a delimiter (decentrl/rl/steps.py)."""

    type: Literal["delimiter"] = "delimiter"
    delimiter: str = Field(
        "\n\n", min_length=1, max_length=64,
        description="A step ends with the token whose text completes a run of this delimiter (repeats count as one).",
    )
    max_steps: int = Field(
        32, ge=1, le=1024, description="Most steps per completion: past it, the rest of the completion is the last step."
    )


class TurnStepsConfig(Section):
    """Steps of an episode are its model turns: each run of loss_mask = 1 tokens (decentrl/rl/steps.py)."""

    type: Literal["turns"] = "turns"
    max_steps: int = Field(
        32, ge=1, le=1024, description="Most steps per completion: past it, the remaining turns form the last step."
    )


StepsConfig = keyed_union(DelimiterStepsConfig, TurnStepsConfig)


class OverlongConfig(Section):
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv 2503.14476, eq. 13), added to the reward
    of a completion of L tokens before advantages are computed (decentrl/rl/advantages.py
    `overlong_penalty`):

        R_len(L) = 0                                       L <= max_length - cache
                 = penalty * ((max_length - cache) - L) / cache   max_length - cache < L <= max_length
                 = -penalty                                L > max_length
    """

    max_length: int = Field(
        ge=1, le=131072, description="L_max: completions longer than this get the full punishment; at most "
        "sampling.max_tokens (DAPO: equal to it, so the punishment grows over the last `cache` tokens of the budget)."
    )
    cache: int = Field(
        ge=0, le=131072, description="L_cache: the band (max_length - cache, max_length] over which the punishment "
        "grows linearly from 0 to -penalty (DAPO: 4096 of 20480); 0 = a step at max_length."
    )
    penalty: float = Field(1.0, gt=0.0, le=1000.0, description="Size of the full punishment (DAPO: 1).")

    @model_validator(mode="after")
    def _band_fits(self) -> OverlongConfig:
        if self.cache > self.max_length:
            raise ValueError(
                f"orchestrator.advantages.overlong.cache ({self.cache}) must be at most max_length ({self.max_length}): "
                "the punished band (max_length - cache, max_length] starts at a length >= 0; lower cache"
            )
        return self


class AdvantageConfig(Section):
    """Advantages, computed by the orchestrator when a batch is built (decentrl/rl/advantages.py).

    Outcome rewards, by `type` (`ESTIMATORS`): grpo, each reward minus its group's mean (divided
    by the group's std with normalize_std); rloo, minus the mean of the group's other rewards;
    reinforce_pp, the batch's rewards whitened by the batch's mean and std; reinforce_pp_baseline,
    each reward minus its group's mean, divided by the batch's std of those. `overlong` shapes the
    rewards first; `mask_truncated` keeps truncated samples out of the loss.

    Process rewards, when a scorer gives a score per step
    (`process_advantages`, docs/rewards.md#process-rewards): every step score of the group is
    normalized the same way over all the group's steps, giving s_ij; token t of sample i gets

        A_it = process_weight * P_it + outcome_weight * A_i  (0 where loss_mask is 0)

    with P_it = sum of s_ij over the steps j ending at or after t (`process = "return"`,
    DeepSeekMath's process supervision) or s_ij of t's own step (`process = "step"`).
    """

    type: Literal["grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "roles"] = Field(
        "grpo", description="Outcome advantage estimator: grpo (group mean baseline), rloo (leave-one-out baseline, "
        "arXiv 2402.14740), reinforce_pp (batch mean and std, arXiv 2501.03262), reinforce_pp_baseline (group mean, "
        "then the batch's std), roles (units of roles, [orchestrator.roles]: a node of several samples centred on its "
        "own mean, a one-sample node on a baseline per task kind and role, `single`)."
    )
    single: Literal["rae", "batch"] = Field(
        "rae", description="type = 'roles': the baseline of a one-sample node (the proposer): rae, SPIRAL's "
        "role-conditioned moving average (decay); batch, Absolute Zero's mean over the batch's nodes of that kind and role."
    )
    decay: float = Field(0.95, ge=0.0, lt=1.0, description="type = 'roles', single = 'rae': the moving average's decay.")
    frozen_roles: list[Literal["proposer", "solver"]] = Field(
        default_factory=list, max_length=2, description="type = 'roles': roles whose samples train nothing (advantage 0): "
        "['proposer'] is benchmarks/coevolve.py's frozen-proposer control (one shared policy: its proposals still change "
        "as the solver trains)."
    )
    normalize_std: bool = Field(
        False, description="Divide each group's centered rewards (and centered step scores) by their std (GRPO); "
        "Dr.GRPO leaves it off."
    )
    process: Literal["return", "step"] = Field(
        "return", description="Per-token process advantage: return = sum of the normalized scores of the token's "
        "step and every later step; step = its own step's normalized score only."
    )
    process_weight: float = Field(
        1.0, ge=0.0, le=1000.0, description="Weight of the process advantage P_it in a token's advantage."
    )
    outcome_weight: float = Field(
        0.0, ge=0.0, le=1000.0, description="Weight of the sample's outcome advantage A_i added to every token's "
        "process advantage (samples without step scores keep A_i alone)."
    )
    steps: StepsConfig = Field(
        default_factory=DelimiterStepsConfig,
        description="How a completion is split into the steps a process scorer scores (decentrl/rl/steps.py).",
    )
    overlong: OverlongConfig | None = Field(
        None, description="Present ([orchestrator.advantages.overlong]): DAPO's soft overlong punishment added to each "
        "reward (the samples' `reward` in the batch is the shaped one). Absent: rewards as scored."
    )
    mask_truncated: bool = Field(
        False, strict=True, description="DAPO's overlong filtering: a sample cut at sampling.max_tokens "
        "(finish_reason 'length') gets loss_mask 0 on every token, so it trains nothing; it still counts in its "
        "group's baseline and in grpo/dr_grpo's sample count (trainer.loss.type = 'token' leaves it out entirely)."
    )
    local_weight: float = Field(
        1.0, ge=0.0, le=100.0, description="Tree units ([orchestrator.tree]): lambda, the weight of a branch sample's "
        "local advantage (its reward minus the mean of its pivot's branches) beside the root samples' global one."
    )
    distill: DistillConfig | None = Field(
        None, description="Present ([orchestrator.advantages.distill]): on-policy distillation, each token's advantage "
        "from a teacher scorer's log-prob of it (decentrl/config/distill.py, docs/rewards.md). Absent: none."
    )

    @model_validator(mode="after")
    def _some_weight(self) -> AdvantageConfig:
        if self.process_weight == 0 and self.outcome_weight == 0:
            raise ValueError(
                "orchestrator.advantages: process_weight and outcome_weight are both 0, so every token's advantage "
                "would be 0; set process_weight > 0 (or outcome_weight > 0)"
            )
        if self.normalize_std and self.type not in ("grpo", "roles"):
            raise ValueError(
                f"orchestrator.advantages.normalize_std divides by the group's std (type = 'grpo'); type = '{self.type}' "
                "has its own scale (rloo: none, reinforce_pp*: the batch's std): set normalize_std = false or type = 'grpo'"
            )
        return self


class RewardConfig(Section):
    """Where a rollout's reward comes from (docs/rewards.md): the task's verifier (computed at
    ingest), a model run by scorers (the `scorer` role, leasing samples over HTTP:
    orchestrator/score_queue.py), or a weighted sum of both. A group waits for every sample's
    model score before the trainer sees it, keeping its place in line; it counts toward the
    staleness budget meanwhile and is dropped (counted) if it goes stale waiting."""

    type: Literal["verifier", "model", "sum"] = Field(
        "verifier", description="verifier: the task's reward; model: the scorers' score; sum: "
        "verifier_weight * verifier + model_weight * model."
    )
    verifier_weight: float = Field(1.0, ge=0, le=1e6, description="type = sum: weight of the task's verifier reward.")
    model_weight: float = Field(1.0, ge=0, le=1e6, description="type = sum: weight of the scorers' model score.")
    score_range: tuple[float, float] = Field(
        (0.0, 1.0), description="[min, max] every model score and step score must lie in; a post outside it is refused (400)."
    )
    on_parse_failure: Literal["default", "drop"] = Field(
        "drop", description="A sample whose judge reply could not be parsed (after the scorer's retries): default = "
        "score it default_score; drop = drop its group. Either way counted (judge_parse_failures), never a silent 0."
    )
    default_score: float = Field(0.0, allow_inf_nan=False, description="on_parse_failure = default: the model score used.")
    step_scores: bool = Field(
        False, strict=True, description="Process rewards: scorers are sent each completion's steps (split as "
        "[orchestrator.advantages.steps] says, decentrl/rl/steps.py) and return one score per step, which become "
        "per-token advantages ([orchestrator.advantages] process keys)."
    )
    lease_timeout_s: float = Field(
        30.0, gt=0, le=86400, description="A score lease not answered in full within this (renewable) expires; its "
        "unscored samples go to the next scorer that asks."
    )

    @property
    def uses_model(self) -> bool:
        return self.type != "verifier"

    @model_validator(mode="after")
    def _range_and_default(self) -> RewardConfig:
        low, high = self.score_range
        if not (math.isfinite(low) and math.isfinite(high) and low < high):
            raise ValueError(f"orchestrator.rewards.score_range must be [min, max] with finite min < max, got {list(self.score_range)}")
        if not low <= self.default_score <= high:
            raise ValueError(f"orchestrator.rewards.default_score ({self.default_score}) must lie in score_range {list(self.score_range)}")
        if self.step_scores and self.type == "verifier":
            raise ValueError("orchestrator.rewards.step_scores needs a model reward: set type = 'model' or 'sum'")
        return self


class HedgingConfig(Section):
    """Deterministic runs (`deterministic = true`, docs/reproducibility.md): a lagging place of the next
    batch is leased to another worker too.

    Every copy is the same group bit for bit (per-sample seeds), so the first to complete fills the
    place; the others are closed (`superseded`), their holders told to stop, and their late posts are
    answered as duplicates, never a strike. The batch then waits for the fastest copy of each place
    instead of the slowest of `groups_per_step` leases. Ignored in free-running runs (they take
    whichever groups finish first).
    """

    enabled: bool = Field(True, strict=True, description="Hedge lagging places of the next batch (deterministic runs only).")
    after: float = Field(
        0.5, gt=0.0, le=100.0,
        description="A place is hedged once its newest lease has been out so long that the recent leases which "
        "took that long went on, on average, for at least this many times the median lease time more (a copy "
        "is then expected to finish first; with a light tail of lease times no place is, orchestrator/lease_policy.py). "
        "The last open place of the next batch is hedged at once.",
    )
    max_copies: int = Field(
        2, ge=2, le=8, description="Leases of one place open at once (the first and its hedges), each on another worker."
    )
    batches: int = Field(
        1, ge=1, le=16,
        description="Places of the next this many batches may be hedged by the time rule (1: only the batch the "
        "trainer takes next; more start hedging a batch's stragglers before the trainer waits for it).",
    )


class DynamicSamplingConfig(Section):
    """DAPO's dynamic sampling (Yu et al. 2025, arXiv 2503.14476): batches of groups that carry a
    signal. A group whose rewards are all equal (and, with process rewards, whose step scores are
    too) gives every sample the same advantage: it teaches nothing under a group baseline.

    Each step consumes `ceil(oversample * groups_per_step)` complete groups in their order (a
    deterministic run: that many numbered places), trains the first `groups_per_step` that carry a
    signal (topped up in order with the others when too few do) and drops the rest, counted as
    `zero_signal` or `surplus`. The lease budget grows by the same factor, so the trainer is not
    kept waiting; the same groups are skipped in every replay of a deterministic run.
    """

    enabled: bool = Field(False, strict=True, description="Serve only groups with a reward signal (DAPO dynamic sampling).")
    oversample: float = Field(
        2.0, ge=1.0, le=8.0, allow_inf_nan=False,
        description="Complete groups consumed per step / groups_per_step. Pick about 1 / (share of groups with a "
        "signal): the dashboard's `zero_signal` drops show the share. More wastes generation, less trains on "
        "zero-signal groups when a step has too few with a signal.",
    )


class TreeConfig(Section):
    """`[orchestrator.tree]`: leases are trees (docs/rewards.md "Pivots", issue 47). The worker
    generates each root sample step by step, posts each finished step for scoring, stops a chain
    whose step is judged wrong, and samples `k` continuations from each of `pivots` pivots (a
    step boundary of a root sample); the unit trains with `tree_advantages` (decentrl/rl/advantages.py):
    global over the root's samples plus `[orchestrator.advantages] local_weight` times local over
    each pivot's branches."""

    k: int = Field(4, ge=1, le=64, description="Continuations sampled from each pivot.")
    pivots: int = Field(1, ge=0, le=64, description="Pivots (branch nodes) each unit holds.")
    boundary: Literal["marker", "tokens"] = Field(
        "marker", description="Where a step ends: marker (the token completing `marker`) or every `step_tokens` tokens."
    )
    marker: str = Field("\n", min_length=1, max_length=64, description="The text that ends a step (boundary = marker).")
    step_tokens: int = Field(32, ge=1, le=4096, description="Tokens a step (boundary = tokens).")
    stop_below: float | None = Field(
        None, description="A chain whose step a scorer judges under this score stops there (its tokens to come are "
        "saved). None: chains run to their end whatever the verdicts."
    )
    rule: Literal["utility", "last_right", "random"] = Field(
        "utility", description="How pivots are chosen (decentrl/rl/pivots.py): DEEP-GRPO's utility, the last step "
        "judged right (the scorer's pick), or at random (the control)."
    )
    gamma: float = Field(0.1, ge=0, le=100, description="The utility's depth bias: P(success | ratio) x ratio^gamma.")
    branch: Literal["always", "all_failed"] = Field(
        "always", description="Which units branch: always (each holds its pivots), or all_failed: only a unit none of "
        "whose roots is known right (each step it names judged at or over stop_below, 0.5 without one) - a group that "
        "may give no gradient; the others are their roots alone."
    )
    verdict_lag_tokens: int | None = Field(
        None, ge=0, le=4096, strict=True,
        description="A step's verdict acts exactly this many of its chain's tokens after the step ended: one not in by "
        "then is waited for (the worker's verdict_wait_s, counted), one in earlier is held until then, so where chains "
        "stop, the tokens discarded and the pivots depend on the seed alone, not on the machine's load "
        "(docs/rewards.md \"Pivots\"). None: a verdict acts whenever it arrives, never waited for while decoding.",
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
    max_inflight_per_token: int = Field(
        16, ge=1, description="Rollout posts of one token processed at once (<= max_inflight_requests counts): "
        "one token's slow or flooding clients get 503 before they crowd out other tokens.",
    )
    body_timeout_s: float = Field(
        30.0, gt=0, description="Most seconds to receive a request body; slower uploads get 408 (a slow client "
        "never holds a place in flight for longer).",
    )
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
        False, description="Serve /metrics and the dashboard's data (/v1/dashboard) without a token (default: a token; "
        "/metrics: trainer or admin)."
    )
    verification: VerificationConfig = Field(
        default_factory=VerificationConfig, description="Checks of untrusted workers (docs/security.md)."
    )
    hedging: HedgingConfig = Field(
        default_factory=HedgingConfig,
        description="Deterministic runs: second leases for the next batch's lagging places (docs/reproducibility.md).",
    )
    advantages: AdvantageConfig = Field(
        default_factory=AdvantageConfig, description="How a complete group's rewards become advantages."
    )
    roles: RolesConfig | None = Field(
        None, description="Present ([orchestrator.roles]): every lease is a unit of roles, a proposer and the solver node "
        "derived from its sample (decentrl/config/roles.py). Absent: plain groups."
    )
    keep_late: int = Field(
        0, ge=0, le=64,
        description="Versions beyond max_staleness a group already leased may lag and still train, its importance "
        "weights correcting it ([trainer.off_policy]); leasing still keeps to max_staleness, so only groups that "
        "finish late use it. 0: late groups are dropped as stale, which biases training toward prompts that finish "
        "fast (each batch's stale_report shows it, docs/trainer.md).",
    )
    dynamic_sampling: DynamicSamplingConfig = Field(
        default_factory=DynamicSamplingConfig,
        description="Batches of groups with a reward signal only, more groups leased to fill them (DAPO).",
    )
    rewards: RewardConfig = Field(
        default_factory=RewardConfig, description="Verifier, model (scorers) or weighted-sum rewards (docs/rewards.md)."
    )
    tree: TreeConfig | None = Field(
        None, description="Present ([orchestrator.tree]): each lease is a tree of a root and branches from pivots, "
        "steps scored while they are generated (issue 47). Absent: plain groups."
    )
