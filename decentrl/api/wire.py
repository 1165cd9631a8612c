"""The HTTP wire contract between workers, the orchestrator and the trainer.

Every request and response body is one of these pydantic models; the orchestrator validates
with them, workers and the trainer build them. Bodies travel as JSON or as msgpack: the same
objects, with the long token id and logprob lists packed as typed little-endian arrays
(decentrl/api/encoding.py, the one module that reads and writes either). docs/api.md describes
every route.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Strict,
    Tag,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    field_validator,
    model_validator,
)

from decentrl.api.encoding import EXT_FLOAT32, EXT_FLOAT64, INT_EXTS, TypedList, value_range

API_PREFIX = "/v1"
WORKER_ID = r"^[A-Za-z0-9._:@-]{1,128}$"  # no "/": lease holders are "token-name/worker-id"
TOKEN_NAME = r"^[A-Za-z0-9._:@-]{1,64}$"  # no "/" either, for the same reason
MAX_VERSION = 2**31 - 1  # versions and prompt ids fit the journal's integers with room to spare
# The longest one GET /v1/version long-poll may wait: under the 60 s read timeout of common reverse
# proxies (nginx's proxy_read_timeout), which would otherwise cut a waiting answer off.
MAX_VERSION_WAIT_S = 60.0

# Size bounds of every list on the wire, whatever the run's config: they bound what one request
# can make the orchestrator hold before its config-derived checks run (orchestrator/checks.py;
# the body itself is bounded by orchestrator.max_request_bytes).
MAX_SEQUENCE = 2**17  # token ids of one prompt or completion (and their per-token lists)
MAX_VOCAB = 2**20  # ids one sampling-mask entry may keep: above any real vocabulary
MAX_ROUTES = 1024  # expert ids routed per token fed (sparse layers x top-k)
# Expert ids of one rollout's routes: 64k tokens fed at MAX_ROUTES each, or a 48-layer top-8 model
# (384 a token) over 170k tokens; the request's max_request_bytes binds first in practice.
MAX_EXPERT_IDS = 2**26
MAX_LIST_IDS = 2**20  # ids of all the per-token lists of one rollout together
MAX_STOP = 64  # stop strings, each at most MAX_TEXT characters
MAX_TEXT = 1024
MAX_STEPS = 4096  # steps of one completion (process rewards)
MAX_SUPERSEDED = 1024  # lease ids one lease answer tells lost (orchestrator/leases.py keeps no more a holder)
# The validation context key of a run's own bound on a sampling-mask entry, (ids, why), which the
# orchestrator passes with a RolloutBatch (orchestrator/handlers.py): top-k keeps at most k ids a
# token, any mask at most the vocabulary. Without it (a client validating), only MAX_VOCAB holds.
MASK_IDS = "mask_ids"

# An integer on the wire is an integer: `true` is not 1 (pydantic's lax mode would take it).
Int = Annotated[int, Strict()]


class Wire(BaseModel):
    model_config = ConfigDict(extra="forbid")


def problems(exc: ValidationError) -> str:
    """A body's validation errors in one line, field by field (the first ten): what the
    orchestrator answers a bad request with, and the client says of a bad answer."""
    return "; ".join(
        f"{'.'.join(str(p) for p in item['loc']) or 'body'}: {item['msg']}" for item in exc.errors()[:10]
    )


def _keep_typed_ints(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    # A non-empty TypedList decoded from an int32/int64 array holds ints by construction: kept
    # as it is (C-speed checks of its values: `value_range`) instead of validating each
    # element again, about 20 ns a number. Anything else, an empty one included, is validated.
    if type(value) is TypedList and value and value.ext.code in INT_EXTS:
        return value
    return handler(value)


def _keep_typed_floats(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    if type(value) is TypedList and value and value.ext.code in (EXT_FLOAT32, EXT_FLOAT64):
        return value
    return handler(value)


# list[int] / list[float] on the wire and in /openapi.json; a msgpack typed array of the right
# kind skips per-element validation (decentrl/api/encoding.py).
IntArray = Annotated[list[Int], WrapValidator(_keep_typed_ints), Field(max_length=MAX_SEQUENCE)]
FloatArray = Annotated[list[float], WrapValidator(_keep_typed_floats), Field(max_length=MAX_SEQUENCE)]
IdLists = Annotated[
    list[Annotated[list[Int], Field(max_length=MAX_VOCAB)]], Field(max_length=MAX_SEQUENCE)
]  # per completion token, a list of ids


class SamplingParams(Wire):
    """The sampling the worker actually applied; logprobs are of this distribution."""

    temperature: float = Field(gt=0, description="Softmax temperature.")
    max_tokens: Int = Field(ge=1, description="Most completion tokens.")
    top_k: Int = Field(0, ge=0, description="0 = no top-k truncation.")
    top_p: float = Field(1.0, gt=0, le=1, description="1.0 = no nucleus truncation.")
    stop: list[Annotated[str, Field(max_length=MAX_TEXT)]] = Field(
        default_factory=list, max_length=MAX_STOP, description="Stop strings; the token completing one is the last token kept."
    )


class RunInfo(Wire):
    """GET /v1/info: what a worker needs to join with only a URL and a token."""

    run_name: str
    store_url: str = Field(description="fsspec URL of the checkpoint store.")
    policy_version: Int | None = Field(description="Newest published version; None before v0 exists.")
    max_staleness: Int = Field(ge=0)
    group_size: Int = Field(ge=1)
    policies: list[Annotated[str, Field(pattern=r"^[a-z][a-z0-9_]{0,31}$")]] | None = Field(
        None, max_length=16, description="A run of two policies ([orchestrator.roles] policies = 'per_role'): their "
        "names; a worker names one in its requests (GET /v1/info?policy= answers with that policy's store_url and "
        "policy_version). None: one policy."
    )
    lease_timeout_s: float | None = Field(
        None, gt=0, allow_inf_nan=False, strict=True, description="[orchestrator] lease_timeout_s: a lease not "
        "renewed within this expires. Workers renew theirs at half the time left and size their requests to it "
        "(docs/workers.md); None: not said (an older orchestrator)."
    )
    keep_routing: bool = Field(
        False, description="MoE runs: every rollout carries its expert routes (docs/routing.md); workers "
        "whose backend cannot record them refuse to start."
    )
    episode_task: dict[str, Any] | None = Field(
        None, description="The run's [task] config when it is multi-turn: workers build its environment from it "
        "(decentrl/tasks/episodes.py). None for single-turn tasks."
    )
    deterministic: bool = Field(
        False, description="A deterministic run (docs/reproducibility.md): sample each lease under its "
        "`policy_version`, seeding sample j of it with decentrl/rl/determinism.py `sample_seed(seed, prompt_id, j, version)`."
    )
    seed: Int = Field(0, ge=0, le=2**63 - 1, description="The run's sampling seed (deterministic runs).")
    vocab_size: Int | None = Field(
        None, ge=1, description="Token ids of the run's tokenizer, added tokens included: every id of a rollout is below it."
    )
    vocab_digest: str | None = Field(
        None, max_length=128, description="Runs with on-policy distillation: sha256 of the run's tokenizer vocabulary "
        "(decentrl/model/tokenizer.py `vocab_digest`); a teacher scorer with another tokenizer refuses to start. None otherwise."
    )


class WorkerMachine(Wire):
    """What a worker computes on (decentrl/model/devices.py `Machine`), shown per worker token in
    /v1/status: a volunteer's own account, for the operator's eyes, never trusted for anything."""

    backend: Literal["hf", "vllm", "openai"]
    device: str = Field(max_length=64, pattern=r"^[A-Za-z0-9 ._:()@+-]*$", description="cpu, or the GPU's name.")
    isa: str = Field(max_length=16, pattern=r"^[a-z0-9_]*$", description="amx, avx512, avx2, arm, default.")
    threads: Int = Field(ge=1, le=4096, description="torch's intra-op threads.")
    compute_dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="The dtype the backend computes in; None before its first version is loaded (or an "
        "engine that does not say: vllm, openai)."
    )


class LeaseRequest(Wire):
    worker_id: str = Field(pattern=WORKER_ID, description="Stable name of the worker.")
    max_groups: Int = Field(ge=1, le=1024, description="Most prompt groups wanted.")
    machine: WorkerMachine | None = Field(None, description="What the worker computes on, for /v1/status.")
    policy: str | None = Field(
        None, pattern=r"^[a-z][a-z0-9_]{0,31}$", description="A run of two policies: the one this worker generates "
        "for (RunInfo.policies); its leases are that policy's nodes and `policy_version` that policy's. None: a run of one."
    )


# -- the widened unit of work (docs/architecture.md, "The unit of work, widened") --------------

NODE_ID = r"^[A-Za-z0-9._:-]{1,64}$"
ROLE_NAME = r"^[a-z][a-z0-9_]{0,31}$"  # a role (proposer, solver) or a policy's name
MAX_NODE_SIZE = 64  # samples of one branch node (k), and pivots of one tree unit
MAX_ROLES = 16


class StepBoundary(Wire):
    """Where one step of a completion ends while it is generated (a tree unit's steps): after a
    token whose text holds `marker` (a newline by default), or after every `tokens` tokens."""

    type: Literal["marker", "tokens"] = Field(description="marker: a step ends with the token that completes `marker`; "
                                              "tokens: every `tokens` completion tokens.")
    marker: str = Field("\n", min_length=1, max_length=64, description="The text that ends a step (type = marker).")
    tokens: Int = Field(32, ge=1, le=MAX_SEQUENCE, description="Completion tokens a step (type = tokens).")


class TreeUnit(Wire):
    """A tree of nodes (process rewards with pivots, issue 47): the root node's `group_size`
    samples, and `pivots` branch nodes of `k` samples, each continuing one root sample after a step
    boundary it posted (before its end). The unit is complete when all `group_size + pivots * k`
    are in; roots that name fewer such boundaries than `pivots` hold one branch node each (none: the
    roots alone, trained as a group), and a unit that branches `all_failed` holds its roots alone
    once one of them is known right (`known_right`)."""

    kind: Literal["tree"]
    k: Int = Field(ge=1, le=MAX_NODE_SIZE, description="Samples of each branch node (continuations of one pivot).")
    pivots: Int = Field(ge=0, le=MAX_NODE_SIZE, description="Branch nodes the unit holds (0: a plain group, steps scored).")
    boundary: StepBoundary = Field(description="Where a step ends while generating.")
    stop_below: float | None = Field(
        None, allow_inf_nan=False, description="A chain whose step is judged (POST /v1/steps, GET /v1/verdicts) under "
        "this score stops there (finish_reason wrong_step). None: chains are never stopped early."
    )
    rule: Literal["utility", "last_right", "random"] = Field(
        "utility", description="How pivots are chosen (decentrl/rl/pivots.py): DEEP-GRPO's utility, the last step "
        "judged right, or at random (the control)."
    )
    gamma: float = Field(0.1, ge=0, le=100, description="The utility's depth bias: P(success | ratio) x ratio^gamma.")
    branch: Literal["always", "all_failed"] = Field(
        "always", description="always: the unit holds its pivots; all_failed: only when none of its roots is known "
        "right (each step it names judged at or over `wrong_below`), else its roots alone."
    )
    verdict_lag_tokens: Int | None = Field(
        None, ge=0, le=4096, description="A step's verdict acts exactly this many of its chain's tokens after the step "
        "ended (waited for, or held until then). None: whenever it arrives."
    )

    @property
    def wrong_below(self) -> float:
        """A step judged under this is wrong: `stop_below`, or 0.5 where chains are never stopped."""
        return self.stop_below if self.stop_below is not None else 0.5

    def known_right(self, verdicts: Sequence[float | None] | None) -> bool:
        """Whether a root whose steps were judged `verdicts` (one per step it names; None: not in)
        is known right: every step judged, none wrong. A unit that branches `all_failed` holds
        branches only when none of its roots is."""
        return bool(verdicts) and all(v is not None and v >= self.wrong_below for v in verdicts or ())


class RolesUnit(Wire):
    """An episode of roles (co-evolution, issue 48): one node per role, `sizes[i]` samples of
    role `roles[i]`; a node larger than `min_fill` may close short once it holds `min_fill` samples
    (the lease policy, orchestrator/roles.py); a smaller one (a proposer's one sample) waits for all."""

    kind: Literal["roles"]
    roles: list[Annotated[str, Field(pattern=ROLE_NAME)]] = Field(min_length=1, max_length=MAX_ROLES)
    sizes: list[Annotated[Int, Field(ge=1, le=1024)]] = Field(min_length=1, max_length=MAX_ROLES)
    min_fill: Int = Field(1, ge=1, le=1024, description="Samples a node needs before it may close short.")

    @model_validator(mode="after")
    def _one_size_a_role(self) -> RolesUnit:
        if len(self.sizes) != len(self.roles):
            raise ValueError(f"{len(self.roles)} roles but {len(self.sizes)} sizes: give one size a role")
        if len(set(self.roles)) != len(self.roles):
            raise ValueError("roles must be distinct")
        if self.min_fill > max(self.sizes):
            raise ValueError(f"min_fill {self.min_fill} is more than the largest node ({max(self.sizes)} samples)")
        return self


Unit = Annotated[TreeUnit | RolesUnit, Field(discriminator="kind")]


class BranchParent(Wire):
    """A branch: a continuation of sample `rollout_id` of the same unit after its first `at`
    completion tokens (a step boundary that sample names in its `step_ends`)."""

    rollout_id: str = Field(min_length=1, max_length=128)
    at: Int = Field(ge=1, le=MAX_SEQUENCE, description="Completion tokens of the parent that are this sample's prefix.")


class DerivedParent(Wire):
    """A derived node: the `derived`-th prompt the task makes from sample `rollout_id` (made by
    the orchestrator, never supplied by a worker)."""

    rollout_id: str = Field(min_length=1, max_length=128)
    derived: Int = Field(ge=0, le=MAX_ROLES * 64, description="Which prompt derived from that sample.")


def _parent_kind(value: Any) -> str | None:
    if isinstance(value, dict):
        return "branch" if "at" in value else "derived" if "derived" in value else None
    return "branch" if isinstance(value, BranchParent) else "derived" if isinstance(value, DerivedParent) else None


Parent = Annotated[
    Annotated[BranchParent, Tag("branch")] | Annotated[DerivedParent, Tag("derived")],
    Discriminator(_parent_kind, custom_error_type="parent", custom_error_message="a parent has rollout_id and at "
                  "(a branch) or rollout_id and derived (a derived node)"),
]


class RolloutNode(Wire):
    """The node of its unit a sample belongs to. Absent: the root node of a plain group."""

    node_id: str = Field(pattern=NODE_ID, description="Unique within the unit; every sample of a node names the same parent.")
    parent: Parent | None = Field(None, description="None: the root node (the lease's prompt).")
    role: str | None = Field(None, pattern=ROLE_NAME, description="Roles units: the role the sample plays.")
    policy: str | None = Field(None, pattern=ROLE_NAME, description="The policy (model) that sampled it, where agents are separate models.")


class Lease(Wire):
    """One prompt leased to one worker: it owes `group_size` samples before `deadline`."""

    lease_id: str
    prompt_id: Int = Field(ge=0, le=MAX_VERSION)
    prompt_token_ids: IntArray
    group_size: Int = Field(ge=1)
    deadline: float = Field(description="Unix time after which the prompt is leased again.")
    index: Int | None = Field(
        None, ge=0, le=MAX_VERSION, description="Deterministic runs: the group's place in the consumption order (None otherwise)."
    )
    policy_version: Int | None = Field(
        None, ge=0, le=MAX_VERSION, description="Deterministic runs: sample under exactly this version (a rollout sampled under "
        "another is rejected as wrong_version). None: the newest the worker has."
    )
    unit: Unit | None = Field(
        None, description="A widened unit of work (docs/architecture.md): a tree (branches from pivots) or roles. "
        "None: a plain group of `group_size` samples."
    )
    node: RolloutNode | None = Field(
        None, description="Roles units: the node this lease's samples belong to; the worker copies it into each "
        "sample's `node`. None: the root node (or a plain group)."
    )
    unit_id: str | None = Field(
        None, min_length=1, max_length=128, description="A sub-lease: the id of the unit (lease) whose derived node it "
        "holds part of; its samples join that unit. None: a lease of its own unit."
    )


ROOT_NODE = "root"  # the node id of a unit's root node, where a sample names it


class LeaseResponse(Wire):
    policy_version: Int | None = Field(description="Newest published version; generate with it.")
    sampling: SamplingParams
    leases: list[Lease] = Field(description="Empty when the run needs no more rollouts right now.")
    retry_after_s: float = Field(0.0, ge=0, description="When empty: wait this long before asking again.")
    superseded: list[Annotated[str, Strict(), Field(min_length=1, max_length=128)]] = Field(
        default_factory=list, max_length=MAX_SUPERSEDED,
        description="Leases of yours that another copy of their place filled first (hedging, deterministic runs): "
        "stop generating them; a post of them is answered as a duplicate. Each is told once.",
    )


# "wrong_step": a tree unit's chain stopped where a step was judged wrong (its last step; issue 47).
FinishReason = Literal["stop", "length", "wrong_step"]


class ExpertRouting(Wire):
    """An MoE sample's routes (Keep Routing, docs/routing.md): `experts` is row-major
    [tokens, layers, top_k], one row per token fed to the model (prompt, then every completion
    token but the last), one block per sparse layer. On msgpack `experts` is a uint8 (uint16 past
    256 experts) typed array."""

    layers: Int = Field(ge=1, le=MAX_ROUTES, description="Sparse layers of the model (dense layers send nothing).")
    top_k: Int = Field(ge=1, le=MAX_ROUTES, description="Experts per token per sparse layer.")
    experts: Annotated[list[Int], WrapValidator(_keep_typed_ints), Field(max_length=MAX_EXPERT_IDS)] = Field(
        description="Expert ids, [tokens, layers, top_k] flattened."
    )

    @model_validator(mode="after")
    def _routes_bounded(self) -> ExpertRouting:
        # The shape against the run's model is a per-rollout check (decentrl/model/routing.py); this
        # only bounds what one token may carry, whatever the run.
        if self.layers * self.top_k > MAX_ROUTES:
            raise ValueError(f"layers x top_k is {self.layers * self.top_k} expert ids a token; at most {MAX_ROUTES}")
        return self


class Rollout(Wire):
    """One sample of a group, as the worker produced it."""

    rollout_id: str = Field(min_length=1, max_length=128, description="Unique; resends are idempotent.")
    run_name: str = Field(max_length=MAX_TEXT)
    lease_id: str = Field(max_length=128, description="The lease this sample answers; also its group id.")
    prompt_id: Int = Field(ge=0, le=MAX_VERSION)
    worker_id: str = Field(pattern=WORKER_ID)
    sample_index: Int | None = Field(
        None, ge=0, le=MAX_VERSION, description="Deterministic runs: j, the sample's place in its group, from which "
        "its seed derives (decentrl/rl/determinism.py `sample_seed`); the verifier re-draws its tokens with it. "
        "None in other runs.",
    )
    policy_version: Int = Field(
        ge=0, le=MAX_VERSION, description="Version of the weights that sampled the first token."
    )
    token_versions: IntArray | None = Field(
        None, description="Per completion token version, when generation spanned a weight swap."
    )
    prompt_token_ids: IntArray = Field(min_length=1)
    completion_token_ids: IntArray = Field(min_length=1)
    logprobs: FloatArray = Field(description="Sampling logprob of each completion token.")
    finish_reason: FinishReason
    sampling: SamplingParams
    sampling_mask: IdLists | None = Field(
        None, description="Per token, the vocabulary ids kept by top-k/top-p truncation (None: all)."
    )
    expert_routing: ExpertRouting | None = Field(
        None, description="MoE runs with keep_routing: the experts every sparse layer chose for each token fed."
    )
    claimed_reward: float | None = Field(None, description="The worker's own reward; never trusted.")
    loss_mask: list[Literal[0, 1]] | None = Field(
        None, max_length=MAX_SEQUENCE, description="Multi-turn episodes: per completion token 1 if the model sampled it, 0 if the "
        "environment inserted it (feedback, tool output; not trained, logprob unused). None: all 1."
    )
    node: RolloutNode | None = Field(
        None, description="Widened units: the node of the lease's unit this sample belongs to. None: the root node."
    )
    step_ends: IntArray | None = Field(
        None, max_length=MAX_STEPS, description="Tree units: the completion token count at the end of each step, "
        "strictly increasing, each at most the completion's length (a branch's `at` is one of its parent's)."
    )

    @field_validator("sampling_mask")
    @classmethod
    def _mask_within_run(cls, mask: list[list[int]] | None, info: ValidationInfo) -> list[list[int]] | None:
        bound = (info.context or {}).get(MASK_IDS)
        if mask is not None and bound is not None:
            (limit, why), widest = bound, max(map(len, mask), default=0)
            if widest > limit:
                raise ValueError(f"keeps {widest} ids for one token; this run allows at most {limit} ({why})")
        return mask

    @model_validator(mode="after")
    def _lengths_agree(self) -> Rollout:
        n = len(self.completion_token_ids)
        for name in ("logprobs", "token_versions", "sampling_mask", "loss_mask"):
            values = getattr(self, name)
            if values is not None and len(values) != n:
                raise ValueError(f"{name} has {len(values)} entries but completion_token_ids has {n}")
        if self.sampling_mask is not None:
            ids = sum(map(len, self.sampling_mask))
            if ids > MAX_LIST_IDS:
                raise ValueError(f"sampling_mask holds {ids} ids in all; at most {MAX_LIST_IDS}")
        if not _valid_logprobs(self.logprobs):
            raise ValueError("logprobs must be finite and <= 0 (log of a probability)")
        ends = self.step_ends
        if ends is not None and (any(b <= a for a, b in zip(ends, ends[1:])) or (ends and (ends[0] < 1 or ends[-1] > n))):
            raise ValueError(f"step_ends must be strictly increasing token counts in [1, {n}] (the completion's length)")
        return self


def _valid_logprobs(logprobs: list[float]) -> bool:
    """Every value finite and <= 0 (1e-4 of rounding allowed): one NaN or -inf would otherwise
    reach the trainer's loss."""
    if not logprobs:
        return True
    if type(logprobs) is TypedList:
        low, high = value_range(logprobs)  # numpy's min and max propagate NaN
        return math.isfinite(low) and high <= 1e-4
    # NaN compares false with everything, so Python's max alone would miss it. A sum is finite
    # only if every term is (NaN and infinities propagate); only when it is not (or a huge sum
    # overflowed) is each value checked in Python.
    if math.isfinite(sum(logprobs)) and max(logprobs) <= 1e-4:
        return True
    return all(math.isfinite(lp) and lp <= 1e-4 for lp in logprobs)


class RolloutBatch(Wire):
    """POST /v1/rollouts body."""

    rollouts: list[Rollout] = Field(min_length=1, max_length=4096)


class Rejection(Wire):
    rollout_id: str
    reason: str


class IngestResponse(Wire):
    accepted: Int = Field(ge=0)
    duplicates: Int = Field(0, ge=0, description="Already acknowledged earlier; counted once.")
    rejected: list[Rejection] = Field(default_factory=list)


# -- scorers: model-judged rewards as their own role (orchestrator/score_queue.py, docs/rewards.md) --

MAX_SCORE_ITEMS = 1024  # items one score lease holds, and scores one post carries
MAX_SCORE_TEXT = 2**20  # characters of one prompt, message or completion text sent to a scorer


class ScoreLeaseRequest(Wire):
    """POST /v1/score/leases (scorer): lease samples to score."""

    scorer_id: str = Field(pattern=WORKER_ID, description="Stable name of the scorer process.")
    max_items: Int = Field(ge=1, le=MAX_SCORE_ITEMS, description="Most samples wanted.")
    ahead: Annotated[bool, Strict()] = Field(
        False, description="Asked while the scorer still has samples to score (a lease in hand): the samples "
        "waiting go first to scorers with nothing to do, and to this one only when none of those is asking."
    )


class ChatMessage(Wire):
    role: str = Field(max_length=64)
    content: str = Field(max_length=MAX_SCORE_TEXT)


class ScoreItem(Wire):
    """One sample to score: the task's prompt and the decoded completion (special tokens removed)."""

    rollout_id: str = Field(min_length=1, max_length=128, description="The sample; scores are posted by it.")
    prompt_id: Int = Field(ge=0, le=MAX_VERSION)
    prompt: str = Field(max_length=MAX_SCORE_TEXT, description="The task's prompt text (before any chat template).")
    messages: list[ChatMessage] | None = Field(
        None, max_length=MAX_STEPS, description="The prompt as chat messages (system, user, ...) when the run renders "
        "prompts with a chat template; None for raw prompts."
    )
    completion: str = Field(max_length=MAX_SCORE_TEXT, description="The completion text.")
    steps: list[Annotated[str, Field(max_length=MAX_SCORE_TEXT)]] | None = Field(
        None, max_length=MAX_STEPS, description="Process rewards: the completion split into steps (decentrl/rl/steps.py); "
        "the post must carry one step score per step. None: no step scores wanted (post step_scores = null)."
    )
    prompt_token_ids: IntArray | None = Field(
        None, description="On-policy distillation ([orchestrator.advantages.distill]): the prompt's token ids as the "
        "student was given them; the teacher scores the completion after exactly these. None otherwise."
    )
    completion_token_ids: IntArray | None = Field(
        None, description="On-policy distillation: the completion's token ids as the student sampled them; the post "
        "must carry one teacher log-prob for each (`token_logprobs`). None otherwise (post token_logprobs = null)."
    )
    step: Int | None = Field(
        None, ge=0, lt=MAX_STEPS, description="Partial steps (POST /v1/steps): judge only this step of a sample still "
        "being generated: `completion` is its text so far and ends with the step, `steps` its steps so far, this one "
        "last; post its `score` (and `step` alike), step_scores null. None: a whole sample."
    )


# -- partial steps (issue 47): a tree unit's steps scored while its samples are generated --------

MAX_STEPS_A_POST = 256


class PartialStep(Wire):
    """One finished step of a sample still being generated: step `step` of `rollout_id` is
    `token_ids` (sampled with `logprobs`), following its steps 0..step-1."""

    rollout_id: str = Field(min_length=1, max_length=128)
    step: Int = Field(ge=0, lt=MAX_STEPS, description="0 for the first step; each follows the one before it.")
    token_ids: IntArray = Field(min_length=1, description="The step's completion tokens.")
    logprobs: FloatArray = Field(description="Sampling logprob of each of the step's tokens.")
    prompt_token_ids: IntArray | None = Field(
        None, description="Step 0 only: the sample's prompt, the lease's (a branch's: the lease's plus its prefix)."
    )

    @model_validator(mode="after")
    def _fits(self) -> PartialStep:
        if len(self.logprobs) != len(self.token_ids):
            raise ValueError(f"logprobs has {len(self.logprobs)} entries but token_ids has {len(self.token_ids)}")
        if not _valid_logprobs(self.logprobs):
            raise ValueError("logprobs must be finite and <= 0 (log of a probability)")
        if (self.prompt_token_ids is None) != (self.step > 0):
            raise ValueError("step 0 carries the sample's prompt_token_ids, and no later step does")
        return self


class StepPost(Wire):
    """POST /v1/steps (worker): finished steps of samples of a lease it holds, for scoring while
    the rest is generated. Idempotent by (rollout id, step): a step already taken is a duplicate."""

    lease_id: str = Field(min_length=1, max_length=128)
    worker_id: str = Field(pattern=WORKER_ID)
    steps: list[PartialStep] = Field(min_length=1, max_length=MAX_STEPS_A_POST)


class StepAck(Wire):
    accepted: Int = Field(ge=0)
    duplicates: Int = Field(0, ge=0, description="Steps already taken; counted once.")


class StepVerdict(Wire):
    """A scorer's judgement of one posted step; `seq` orders every verdict of the run."""

    lease_id: str
    rollout_id: str
    step: Int = Field(ge=0)
    score: float = Field(allow_inf_nan=False)
    seq: Int = Field(ge=1)


class VerdictList(Wire):
    """GET /v1/verdicts (worker): the verdicts on steps of its open leases after `after`, as soon
    as there is one (or when `wait_s` runs out); ask again with `after = last`."""

    verdicts: list[StepVerdict]
    last: Int = Field(ge=0, description="The newest seq answered (or `after` when none): the next request's `after`.")


class ScoreLease(Wire):
    """POST /v1/score/leases answer: samples this scorer owes scores for before `deadline`.

    Empty `items` when nothing waits (ask again after `retry_after_s`). A lease not answered in
    full by its deadline expires: its unscored items go to the next scorer that asks, and a late
    post for them is refused (409)."""

    lease_id: str = Field(description="Empty when `items` is empty.")
    deadline: float = Field(description="Unix time after which unscored items are leased again (renewable).")
    items: list[ScoreItem] = Field(max_length=MAX_SCORE_ITEMS)
    score_range: tuple[float, float] = Field(description="[min, max] a score (and a step score) must lie in.")
    retry_after_s: float = Field(0.0, ge=0, description="When empty: wait this long before asking again.")


class ScoreRenewal(Wire):
    """POST /v1/score/leases/{lease_id}/renew answer."""

    lease_id: str
    deadline: float = Field(description="The new deadline: score_lease_timeout_s from now.")
    unscored: Int = Field(ge=0, description="Items of the lease still waiting for a score.")


ScoreValue = Annotated[float, Strict(), Field(allow_inf_nan=False)]  # `true` is not a score


class ScoreResult(Wire):
    """One sample's score. A judge reply that could not be parsed after the scorer's retries is
    posted as `failure = "parse"` with `score = null`; the orchestrator then applies the task's
    `on_parse_failure` (a default score, or the group dropped), counted, never a silent 0."""

    rollout_id: str = Field(min_length=1, max_length=128)
    score: ScoreValue | None = Field(description="Finite, within the lease's score_range; null only with a failure.")
    step_scores: list[ScoreValue] | None = Field(
        None, max_length=MAX_STEPS, description="One per step of the item's `steps` (process rewards); null when the "
        "item had no steps."
    )
    failure: Literal["parse"] | None = Field(None, description="Why there is no score (the judge's reply did not parse).")
    step: Int | None = Field(None, ge=0, lt=MAX_STEPS, description="The item's `step`: a partial step's verdict.")
    token_logprobs: FloatArray | None = Field(
        None, description="On-policy distillation: the teacher's log-prob of each of the item's `completion_token_ids`, "
        "in order, finite and <= 0; null for an item without token ids."
    )

    @model_validator(mode="after")
    def _score_or_failure(self) -> ScoreResult:
        if (self.score is None) == (self.failure is None):
            raise ValueError("give either a score or a failure (score = null with failure = 'parse'), not both or neither")
        if self.failure is not None and (self.step_scores is not None or self.token_logprobs is not None):
            raise ValueError("a failed item carries no step_scores and no token_logprobs")
        if self.token_logprobs is not None and not _valid_logprobs(self.token_logprobs):
            raise ValueError("token_logprobs must be finite and <= 0 (log of a probability)")
        return self


class ScorePost(Wire):
    """POST /v1/scores (scorer): scores for items of a lease this scorer holds; a subset is fine
    (post as they finish). Idempotent by rollout id: a score already taken is a duplicate."""

    lease_id: str = Field(min_length=1, max_length=128)
    scorer_id: str = Field(pattern=WORKER_ID, description="The scorer id that leased it.")
    scores: list[ScoreResult] = Field(min_length=1, max_length=MAX_SCORE_ITEMS)
    parse_retries: Int = Field(
        0, ge=0, le=2**20, description="Judge replies that did not parse and were asked again, for these items (a metric)."
    )


class ScoreAck(Wire):
    accepted: Int = Field(ge=0)
    duplicates: Int = Field(0, ge=0, description="Scores for these rollouts already taken; counted once.")
    unscored: Int = Field(ge=0, description="Items of the lease still waiting; 0: the lease is done.")


class TrainSample(Wire):
    """One sample as the trainer consumes it: tokens, sampling logprobs and its advantage."""

    prompt_token_ids: IntArray
    completion_token_ids: IntArray
    logprobs: FloatArray
    advantage: float
    reward: float
    policy_version: Int
    group_id: str | None = Field(None, description="The group (lease) it belongs to; the trainer filters by group.")
    rollout_id: str | None = Field(None, description="The worker's rollout id, to trace a sample back.")
    sampling_mask: IdLists | None = Field(
        None, description="The rollout's sampling mask: per completion token, the vocabulary ids kept by "
        "top-k/top-p (None: no truncation). The trainer truncates its distribution the same way."
    )
    loss_mask: list[Literal[0, 1]] | None = Field(
        None, max_length=MAX_SEQUENCE, description="The rollout's loss mask (multi-turn): 0 marks environment tokens the trainer skips."
    )
    expert_routing: ExpertRouting | None = Field(
        None, description="The rollout's MoE routes; the trainer replays them (docs/routing.md)."
    )
    token_advantages: FloatArray | None = Field(
        None, description="Process rewards: one finite advantage per completion token (decentrl/rl/advantages.py "
        "`process_advantages`, docs/rewards.md); the trainer uses them instead of `advantage`. None: every token "
        "has `advantage`."
    )

    @model_validator(mode="after")
    def _token_advantages_fit(self) -> TrainSample:
        if self.token_advantages is None:
            return self
        n = len(self.completion_token_ids)
        if len(self.token_advantages) != n:
            raise ValueError(f"token_advantages has {len(self.token_advantages)} entries but completion_token_ids has {n}")
        if not _all_finite(self.token_advantages):
            raise ValueError("token_advantages must be finite numbers")
        return self


def _all_finite(values: list[float]) -> bool:
    if type(values) is TypedList and values:
        return all(map(math.isfinite, value_range(values)))  # numpy's min and max propagate NaN
    return all(map(math.isfinite, values))  # Python's min and max would not


class StaleReport(Wire):
    """What the staleness rule dropped since the previous batch, to hold against what a batch
    trains: dropping late groups biases training toward prompts that finish fast, which shows as
    dropped completions longer (and rewards lower) than kept ones (docs/trainer.md)."""

    samples: Int = Field(ge=0, description="Samples dropped as stale since the previous batch.")
    mean_length: float | None = Field(None, allow_inf_nan=False, description="Their mean completion tokens.")
    mean_reward: float | None = Field(
        None, allow_inf_nan=False, description="Their mean reward, of those rewarded before the drop (a group dropped "
        "before it was complete, or before its model scores, has none)."
    )


class TrainBatch(Wire):
    """GET /v1/batch answer: complete groups, fresh for the trainer's current version."""

    trainer_version: Int = Field(ge=0)
    samples: list[TrainSample]
    staleness_histogram: dict[str, Int] = Field(description="Samples per (trainer_version - policy_version).")
    rollouts_accepted: Int = Field(ge=0, description="Run total acknowledged so far.")
    stale_dropped: Int = Field(ge=0, description="Run total dropped as stale (ingest or buffer).")
    stale_report: StaleReport | None = Field(None, description="Dropped as stale since the previous batch.")
    batch_id: str | None = Field(
        None, description="Unique per batch; a resent request (same request_id) gets the same batch again."
    )


class VersionAnnouncement(Wire):
    """POST /v1/version (trainer): version N is complete in the store."""

    version: Int = Field(ge=0, le=MAX_VERSION)
    policy: str | None = Field(
        None, pattern=r"^[a-z][a-z0-9_]{0,31}$", description="A run of two policies: the policy whose stream this "
        "version is of (RunInfo.policies). None: a run of one."
    )


class PublishedVersion(Wire):
    """GET /v1/version: the newest published version, as soon as it is newer than the caller's `after`."""

    policy_version: Int | None = Field(
        ge=0, le=MAX_VERSION, description="Newest published version; None before v0 exists. Not newer than `after` "
        "when the wait ran out (or the orchestrator is stopping): ask again."
    )


METRIC_NAME = r"^[a-z][a-z0-9_]{0,63}$"
MAX_STEP_METRICS = 64


class TrainerStep(Wire):
    """POST /v1/trainer/steps (trainer): one optimizer step's metrics, for the dashboard.

    Only finite numbers (a non-finite value stays in the trainer's metrics.jsonl); at most
    MAX_STEP_METRICS of them, named like `grad_norm`. The orchestrator keeps the newest few
    thousand steps in memory (orchestrator/history.py) and never journals them.
    """

    step: Int = Field(ge=1, le=MAX_VERSION)
    metrics: dict[Annotated[str, Field(pattern=METRIC_NAME)], Annotated[float, Strict(), Field(allow_inf_nan=False)]] = Field(
        max_length=MAX_STEP_METRICS, description="Metric name -> value (loss, grad_norm, entropy, ...)."
    )

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> TrainerStep:
        """The numeric, finite entries of a metrics.jsonl record (decentrl/trainer/metrics.py)."""
        metrics = {
            name: float(value) for name, value in record.items()
            if name != "step" and type(value) in (int, float) and math.isfinite(value)
        }
        return cls(step=int(record["step"]), metrics=dict(sorted(metrics.items())[:MAX_STEP_METRICS]))


class StatusResponse(Wire):
    """GET /v1/status: counters for progress displays."""

    run_name: str
    policy_version: Int | None
    trainer_version: Int
    rollouts_accepted: Int
    rollouts_rejected: dict[str, Int]
    stale_dropped: Int
    groups_ready: Int
    groups_served: Int
    leases_active: Int
    leases_expired: Int
    reward_mean_recent: float | None
    uptime_s: float
    rollouts_duplicate: Int = Field(0, description="Resends of rollouts already acknowledged (counted once).")
    hedged_leases: Int = Field(
        0, description="Deterministic runs: second leases granted for a lagging place of the next batch (hedges)."
    )
    hedge_duplicates: Int = Field(
        0, description="Samples of a hedge's losing copy posted after the winner filled the place (also duplicates)."
    )
    hedge_mismatches: Int = Field(
        0, description="Of those, samples that differ from the winner's sample of the same index (docs/reproducibility.md)."
    )
    hedge_copies_told: Int = Field(
        0, description="Losing copies of a hedge whose holders were told, in a lease answer, to stop generating them."
    )
    dropped: dict[str, Int] = Field(
        default_factory=dict, description="Accepted samples dropped later, per reason (stale, lease expired, ...)."
    )
    buffer_limit: Int | None = Field(None, description="Depth bound: ready groups plus open leases.")
    journal: bool = Field(False, description="Whether acknowledged state is journaled on disk.")
    recoveries: Int = Field(0, description="How many times this run's state was recovered from the journal.")
    groups_skipped: Int = Field(
        0, description="Dynamic sampling: complete groups a step consumed and did not train (dropped as zero_signal or "
        "surplus; their samples are in `dropped`)."
    )
    groups_verifying: Int = Field(0, description="Complete groups pending until their logprob spot-check is done.")
    groups_scoring: Int = Field(0, description="Complete groups pending until scorers have scored every sample.")
    scoring: dict[str, Int] | None = Field(
        None, description="Model rewards (docs/rewards.md): samples waiting and leased, score leases open; since this "
        "orchestrator started: scores_posted, scores_duplicate, scores_reassigned, score_leases_expired, "
        "judge_parse_failures, judge_parse_retries; with tree units steps_waiting and steps_scored (verdicts on "
        "partial steps). None when nothing is scored (a verifier reward without tree units)."
    )
    verification: dict[str, float] | None = Field(
        None, description="Logprob spot-checks: rollouts_checked, checks, loads, compute_s, cpu_s, load_s, load_cpu_s, "
        "forward_s, forward_cpu_s, startup_s, largest_passing_diff, largest_passing_mean_diff, tolerance, "
        "mean_tolerance (the bounds in force for the run's publish dtype; None when verification is off; docs/security.md).",
    )
    workers: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="Per token: rollouts, checked, passed (pending groups whose check passed), strikes, "
        "reward_mismatches (claimed reward disagreed; never used), served, rejections by reason, banned "
        "(docs/security.md); and `machine`, what its worker said it computes on in its last lease request "
        "(backend, device, isa, threads, compute_dtype: WorkerMachine).",
    )
    reward_failures: dict[str, int] = Field(
        default_factory=dict,
        description="Reward calls of the task's own reward code that failed and scored 0, by kind (timeout, "
        "error, out_of_range); only tasks whose rewards run in the reward guard (dataset, reasoning_gym, "
        "verifiers; docs/tasks.md). Counted since this orchestrator started (not journaled).",
    )


class LeaseState(Wire):
    """GET /v1/leases/{lease_id}: where one lease stands (its holder only)."""

    lease_id: str
    prompt_id: Int
    state: Literal["open", "complete", "served", "expired", "released", "dropped", "superseded", "skipped"]
    samples: Int = Field(ge=0, description="Samples acknowledged for it so far.")
    group_size: Int = Field(ge=1)
    deadline: float = Field(description="Unix time; for an open lease, when it expires.")


class ErrorBody(Wire):
    """Every 4xx/5xx answer: one human-readable sentence saying what to fix."""

    error: str


class TokenCreate(Wire):
    """POST /v1/admin/tokens (admin): a new bearer token."""

    name: str = Field(pattern=TOKEN_NAME, description="Who holds it; unique.")
    role: Literal["worker", "trainer", "scorer", "admin"] = "worker"


class TokenCreated(Wire):
    name: str
    role: Literal["worker", "trainer", "scorer", "admin"]
    token: str = Field(description="Shown once: the orchestrator keeps only the tokens file.")


class TokenEntry(Wire):
    name: str
    role: Literal["worker", "trainer", "scorer", "admin"]
    source: Literal["file", "env", "memory"]


class TokenList(Wire):
    """GET /v1/admin/tokens (admin): names and roles, never the tokens."""

    tokens: list[TokenEntry]


class Health(Wire):
    """GET /healthz: liveness for load balancers; 503 when the journal has failed."""

    ok: bool
    journal: bool
