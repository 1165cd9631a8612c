"""`RunConfig`: everything one run needs, built from each role's section.

Each role reads its own section plus the shared ones: the orchestrator [orchestrator],
[sampling], [task], [prompt], [model], [store]; workers [worker], [store] and [simulation]; the trainer
[trainer], [model], [store]; scorers [scorer]; `decentrl run` the top-level counts and [placement]. Checks that span sections live
here, with errors that say which keys to change.
"""

from __future__ import annotations

import math

from pydantic import Field, model_validator

from decentrl.config.base import Section
from decentrl.config.logging import LoggingConfig
from decentrl.config.model import ModelConfig, TinyModelConfig
from decentrl.config.orchestrator import OrchestratorConfig, SamplingConfig
from decentrl.config.placement import Placed, PlacementConfig, memory_overcommit
from decentrl.config.prompt import PromptConfig
from decentrl.config.scorer import ScorerConfig
from decentrl.config.simulation import SimulationConfig
from decentrl.config.store import StoreConfig
from decentrl.config.task import SortingTaskConfig, TaskConfig
from decentrl.config.trainer import TrainerConfig
from decentrl.config.worker import WorkerConfig


class RunConfig(Section):
    """Everything one run needs; each role reads its own section plus the shared ones."""

    run_name: str = Field("demo", pattern=r"^[A-Za-z0-9._-]{1,64}$", description="Run id.")
    max_staleness: int = Field(
        1, ge=0, le=1024, description="Rollouts from version v train step s iff s - v <= this; 0 = synchronous."
    )
    group_size: int = Field(8, ge=2, le=1024, description="Samples per prompt (GRPO group).")
    seed: int = Field(
        0, ge=0, description="The run's sampling seed: with `deterministic`, every sample's randomness derives "
        "from (seed, prompt id, sample index, policy version) (docs/reproducibility.md)."
    )
    deterministic: bool = Field(
        False, description="Same seed, same run, whatever the number and timing of workers: each group is "
        "sampled under the version its place in the consumption order fixes, with per-sample seeds, and "
        "batches take groups in that order; deterministic kernels everywhere (docs/reproducibility.md)."
    )
    model: ModelConfig = Field(default_factory=TinyModelConfig, description="The policy ([model] type = ...).")
    task: TaskConfig = Field(default_factory=SortingTaskConfig, description="Prompts and reward ([task] type = ...).")
    prompt: PromptConfig = Field(default_factory=PromptConfig, description="Chat template or raw prompts.")
    store: StoreConfig = Field(default_factory=StoreConfig, description="Where versions live.")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="How workers sample.")
    orchestrator: OrchestratorConfig = Field(default_factory=OrchestratorConfig, description="The central service.")
    worker: WorkerConfig = Field(default_factory=WorkerConfig, description="Inference workers.")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="The FSDP2 trainer.")
    scorer: ScorerConfig | None = Field(
        None, description="Scorer processes (`decentrl scorer`): their backend ([scorer] type = 'hf', 'openai' or "
        "'python'); None in runs that score with verifiers only."
    )
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="Experiment trackers (trainer).")
    simulation: SimulationConfig = Field(
        default_factory=SimulationConfig, description="Benchmarks only: injected generation delays."
    )
    num_workers: int = Field(2, ge=1, le=64, description="Workers `decentrl run` starts locally.")
    trainer_ranks: int = Field(2, ge=1, le=64, description="Trainer processes `decentrl run` starts.")
    num_scorers: int = Field(
        0, ge=0, le=64, description="Scorers `decentrl run` starts locally (with [scorer]); 0: none (scorers may "
        "also run elsewhere, `decentrl scorer`)."
    )
    tolerate_worker_exits: bool = Field(
        False, description="`decentrl run` keeps going when a worker (or a scorer) dies, as long as one of its kind is left."
    )
    placement: PlacementConfig = Field(
        default_factory=PlacementConfig, description="`decentrl run`: the GPUs of the trainer's ranks, the workers "
        "and the scorers, and each process's share of their memory; left out, every role stays on its own device."
    )

    @property
    def train_staleness(self) -> int:
        """The most versions a sample may lag the trainer and still train: max_staleness, plus
        orchestrator.keep_late for groups that finish late (leasing keeps to max_staleness)."""
        return self.max_staleness + self.orchestrator.keep_late

    @property
    def places_per_step(self) -> int:
        """Complete groups each step consumes, in order: groups_per_step, times the oversampling of
        dynamic sampling when it is on (the others are dropped at the step: orchestrator/state.py)."""
        dynamic = self.orchestrator.dynamic_sampling
        groups = self.trainer.groups_per_step
        return math.ceil(dynamic.oversample * groups) if dynamic.enabled else groups

    @model_validator(mode="after")
    def _batch_divides(self) -> RunConfig:
        samples = self.trainer.groups_per_step * self.group_size
        if samples % self.trainer_ranks:
            raise ValueError(
                f"trainer.groups_per_step * group_size ({samples}) must be divisible by "
                f"trainer_ranks ({self.trainer_ranks}) so every rank trains on the same number of samples"
            )
        return self

    @model_validator(mode="after")
    def _scorers_have_a_backend(self) -> RunConfig:
        if self.num_scorers and self.scorer is None:
            raise ValueError("num_scorers needs a [scorer] section (type = 'hf', 'openai' or 'python'; docs/rewards.md)")
        if self.num_scorers and not self.orchestrator.rewards.uses_model:
            raise ValueError(
                "num_scorers > 0 but orchestrator.rewards.type = 'verifier' asks scorers for nothing: "
                "set orchestrator.rewards.type = 'model' or 'sum', or num_scorers = 0"
            )
        return self

    @model_validator(mode="after")
    def _roles_fit(self) -> RunConfig:
        roles, propose = self.orchestrator.roles, self.task.type == "propose"
        if (roles is None) != (not propose) or (roles is None) != (self.orchestrator.advantages.type != "roles"):
            raise ValueError(
                "units of roles go together: [task] type = 'propose', [orchestrator.roles] and "
                "orchestrator.advantages.type = 'roles' are set all three or none"
            )
        if roles is not None and (self.deterministic or self.orchestrator.rewards.type != "verifier"):
            raise ValueError(
                "[orchestrator.roles] runs free (deterministic = false) with the task's verifier rewards "
                "(orchestrator.rewards.type = 'verifier'): set both"
            )
        names = roles.policy_names if roles is not None else ()
        for section, policy in (("trainer", self.trainer.policy), ("worker", self.worker.policy)):
            if policy is not None and policy not in names:
                raise ValueError(
                    f"{section}.policy = {policy!r} but this run's policies are {list(names) or 'one, shared'}: "
                    + (f"set it to one of {list(names)}" if names else "remove it, or set [orchestrator.roles] policies = 'per_role'")
                )
        if names and self.num_workers < len(names):
            raise ValueError(
                f"[orchestrator.roles] policies = 'per_role' needs a worker per policy: num_workers = {self.num_workers}, "
                f"at least {len(names)}"
            )
        return self

    @model_validator(mode="after")
    def _loss_matches_advantages(self) -> RunConfig:
        if self.trainer.loss.type == "dr_grpo" and self.orchestrator.advantages.normalize_std:
            raise ValueError(
                "trainer.loss.type = 'dr_grpo' removes the std normalization of advantages: "
                "set orchestrator.advantages.normalize_std = false, or use trainer.loss.type = 'grpo'"
            )
        return self

    @model_validator(mode="after")
    def _overlong_within_budget(self) -> RunConfig:
        overlong = self.orchestrator.advantages.overlong
        if overlong is not None and overlong.max_length > self.sampling.max_tokens:
            raise ValueError(
                f"orchestrator.advantages.overlong.max_length ({overlong.max_length}) exceeds sampling.max_tokens "
                f"({self.sampling.max_tokens}): no completion is longer than max_tokens; set max_length <= "
                f"{self.sampling.max_tokens} (DAPO: max_length = max_tokens)"
            )
        return self

    @model_validator(mode="after")
    def _compile_dense(self) -> RunConfig:
        if self.trainer.compile and getattr(self.model, "moe", None) is not None:
            raise ValueError(
                "trainer.compile = true needs a dense model: [model.moe] routes are replayed with hooks a compiled "
                "block would not follow; set trainer.compile = false, or drop [model.moe]"
            )
        return self

    @model_validator(mode="after")
    def _deterministic_backend(self) -> RunConfig:
        if self.deterministic and self.worker.backend != "hf":
            raise ValueError(
                f"deterministic = true needs [worker] backend = 'hf' (per-sample seeded sampling); the "
                f"{self.worker.backend!r} backend samples with its own RNG: set deterministic = false, "
                "or backend = 'hf' (docs/reproducibility.md)"
            )
        return self

    @model_validator(mode="after")
    def _tree_not_deterministic(self) -> RunConfig:
        # A seeded unit draws the same samples every time (workers/tree.py `seed`); what is not built:
        # a tree played at the lease's version, the verifier's re-draw of a branch, the utility rule's
        # estimate independent of the order units end in, a unit that cannot be completed failed not requeued.
        if self.deterministic and self.orchestrator.tree is not None:
            raise ValueError(
                "[orchestrator.tree] does not support deterministic = true yet (a tree unit's samples are seeded, but "
                "it is played at the worker's loaded version, not its lease's, and the verifier does not re-draw "
                "branch samples): set deterministic = false, or drop [orchestrator.tree]"
            )
        return self

    @model_validator(mode="after")
    def _tree_backend(self) -> RunConfig:
        if self.orchestrator.tree is not None and self.worker.backend == "openai":
            raise ValueError(
                "[orchestrator.tree] leases are decoded step by step (verdicts read between tokens) by the hf and vllm "
                "backends; worker.backend = 'openai' cannot: set worker.backend = 'hf' or 'vllm', or drop [orchestrator.tree]"
            )
        return self

    @model_validator(mode="after")
    def _router_noise_on_hf(self) -> RunConfig:
        if self.simulation.router_noise and self.worker.backend != "hf":
            raise ValueError(
                f"simulation.router_noise is applied by the hf backend only (worker.backend is "
                f"{self.worker.backend!r}): set worker.backend = \"hf\" or drop router_noise"
            )
        return self

    @model_validator(mode="after")
    def _placement_fits(self) -> RunConfig:
        placement = self.placement
        if placement.trainer.gpus and len(placement.trainer.gpus) != self.trainer_ranks:
            raise ValueError(
                f"placement.trainer.gpus lists {len(placement.trainer.gpus)} GPU(s) {placement.trainer.gpus} but "
                f"trainer_ranks = {self.trainer_ranks}: one GPU per rank, so list {self.trainer_ranks} GPUs "
                f"or set trainer_ranks = {len(placement.trainer.gpus)}"
            )
        for role, count, setting in (("workers", self.num_workers, "num_workers"), ("scorers", self.num_scorers, "num_scorers")):
            gpus = getattr(placement, role).gpus
            if count and len(gpus) > count:
                raise ValueError(
                    f"placement.{role}.gpus lists {len(gpus)} GPUs {gpus} but {setting} = {count}: GPUs past the "
                    f"first {count} would get no process; list {count} GPU(s) or set {setting} = {len(gpus)}"
                )
        if placement.workers.gpus and self.worker.backend == "openai":
            raise ValueError(
                "placement.workers.gpus places workers on GPUs but worker.backend = 'openai' runs no model in the "
                "worker (its server does): set placement.workers.gpus = []"
            )
        scorer = self.scorer
        runs_a_model = scorer is not None and (scorer.type == "hf" or (scorer.type == "teacher" and scorer.server is None))
        if placement.scorers.gpus and self.num_scorers and not runs_a_model:
            kind = "no [scorer]" if scorer is None else f"scorer.type = {scorer.type!r}"
            if scorer is not None and scorer.type == "teacher":
                kind += " with a [scorer.server]"
            raise ValueError(
                f"placement.scorers.gpus places scorers on GPUs but {kind} runs no model in the scorer: "
                "use [scorer] type = 'hf' or a 'teacher' with a path, or set placement.scorers.gpus = []"
            )
        overcommit = memory_overcommit(self.processes())
        if overcommit:
            raise ValueError(overcommit)
        return self

    @model_validator(mode="after")
    def _distill_has_a_teacher(self) -> RunConfig:
        distill, rewards = self.orchestrator.advantages.distill, self.orchestrator.rewards
        # Scorers read [scorer] alone (`decentrl scorer`): the scorer's type is checked against the run's
        # only where `decentrl run` starts them.
        teacher = self.scorer is not None and self.scorer.type == "teacher"
        if distill is None:
            if teacher and self.num_scorers:
                raise ValueError(
                    "[scorer] type = 'teacher' posts per-token log-probs that only on-policy distillation uses: add "
                    "[orchestrator.advantages.distill] (docs/rewards.md), or choose another scorer type"
                )
            return self
        if not rewards.uses_model:
            raise ValueError(
                "orchestrator.advantages.distill needs the teacher's log-probs, which scorers post: set "
                "orchestrator.rewards.type = 'sum' (with model_weight = 0 the task's reward stays as it is) or 'model', "
                "and run scorers with [scorer] type = 'teacher'"
            )
        if rewards.step_scores:
            raise ValueError(
                "orchestrator.advantages.distill and orchestrator.rewards.step_scores both set every token's advantage: "
                "set step_scores = false, or drop [orchestrator.advantages.distill]"
            )
        if self.scorer is not None and self.num_scorers and not teacher:
            raise ValueError(
                f"orchestrator.advantages.distill needs a teacher scorer, but [scorer] type = {self.scorer.type!r}: "
                "set [scorer] type = 'teacher' and its path (docs/rewards.md)"
            )
        return self

    def processes(self) -> dict[str, Placed]:
        """Each process `decentrl run` starts ("trainer", "worker-0", ..., "scorer-0", ...) and its GPUs
        and memory share under [placement] (decentrl/config/placement.py)."""
        return self.placement.processes(
            trainer_ranks=self.trainer_ranks, num_workers=self.num_workers, num_scorers=self.num_scorers
        )

    def with_store_url(self, url: str) -> RunConfig:
        return self.model_copy(update={"store": self.store.model_copy(update={"url": url})})

    @property
    def policies(self) -> tuple[str, ...]:
        """The run's policies when each role is its own model; () for one policy."""
        return self.orchestrator.roles.policy_names if self.orchestrator.roles is not None else ()
