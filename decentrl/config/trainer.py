"""`[trainer]`: the FSDP2 trainer's optimization, loss and checkpointing (decentrl/trainer/ reads it).

The objective, the loss normalization and the off-policy correction are unions keyed by `type`,
each member mapped to its function in decentrl/rl/losses.py; docs/trainer.md explains every choice.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from decentrl.config.base import Section, keyed_union, reject_moved


class PolicyLossBase(Section):
    """PPO clipping shared by every loss normalization (clip-higher: eps_high > eps_low). It clips
    the `ppo` objective (the default); GSPO and CISPO clip with their own [trainer.objective] bounds."""

    eps_low: float = Field(
        0.2, gt=0, le=1, description="PPO clip: a token with negative advantage and ratio < 1 - eps_low gets no gradient "
        "(trainer.objective.type = 'ppo' only)."
    )
    eps_high: float = Field(
        0.28, gt=0, description="PPO clip: a token with positive advantage and ratio > 1 + eps_high gets no gradient "
        "(trainer.objective.type = 'ppo' only)."
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


LossConfig = keyed_union(GRPOLossConfig, TokenLossConfig, DrGRPOLossConfig)


class PPOObjectiveConfig(Section):
    """PPO's clipped surrogate on each token's ratio to the sampling policy (the default): the
    importance weight comes from [trainer.off_policy], the clip range from [trainer.loss]."""

    type: Literal["ppo"] = "ppo"


class GSPOObjectiveConfig(Section):
    """GSPO (Zheng et al. 2025, arXiv 2507.18071): one importance ratio per sample, the geometric
    mean of its token ratios, clipped per sample; GSPO-token, so per-token advantages still work.
    It is its own importance weight: [trainer.off_policy] adds only its mask (icepop, seq_mask)."""

    type: Literal["gspo"] = "gspo"
    eps_low: float = Field(
        3e-4, gt=0, le=1, description="A sample with negative advantage and sequence ratio < 1 - eps_low gets no "
        "gradient (the paper: 3e-4; sequence ratios stay much closer to 1 than token ratios)."
    )
    eps_high: float = Field(
        4e-4, gt=0, description="A sample with positive advantage and sequence ratio > 1 + eps_high gets no gradient "
        "(the paper: 4e-4)."
    )


class CISPOObjectiveConfig(Section):
    """CISPO (MiniMax-M1, arXiv 2506.13585): REINFORCE weighted by the token ratio clipped to
    [1 - eps_low, 1 + eps_high], without gradient; no token's gradient is dropped by the clip.
    It is its own importance weight: [trainer.off_policy] adds only its mask (icepop, seq_mask)."""

    type: Literal["cispo"] = "cispo"
    eps_low: float = Field(
        1.0, gt=0, le=1, description="Floor 1 - eps_low of the weight; 1.0 (the paper): no floor, only eps_high is tuned."
    )
    eps_high: float = Field(0.28, gt=0, description="Ceiling 1 + eps_high of the weight.")


ObjectiveConfig = keyed_union(PPOObjectiveConfig, GSPOObjectiveConfig, CISPOObjectiveConfig)


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


OffPolicyConfig = keyed_union(TISConfig, IcePopConfig, SeqMaskConfig)


class TrainerAdvantagesConfig(Section):
    """What the trainer does with the advantages it receives (the orchestrator computes them:
    [orchestrator.advantages])."""

    drop_zero_variance: bool = Field(
        False,
        description="Train only on groups whose rewards differ: a group of equal rewards has no policy-gradient "
        "signal, only KL/entropy terms and a share of the normalization.",
    )

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data: object) -> object:
        return reject_moved(data, {
            "normalize_std": "[orchestrator.advantages] normalize_std (the orchestrator computes advantages)"
        })


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
    policy: str | None = Field(
        None, pattern=r"^[a-z][a-z0-9_]{0,31}$", description="A run of two policies ([orchestrator.roles] policies = "
        "'per_role'): the one this trainer trains and publishes (proposer or solver); `decentrl run` sets it. None: the "
        "run's one policy.",
    )
    groups_per_step: int = Field(32, ge=1, description="Prompt groups in one batch.")
    lr: float = Field(1e-3, gt=0, lt=1, description="AdamW learning rate.")
    lr_warmup_steps: int = Field(0, ge=0, description="Linear warmup of the learning rate over these steps; 0 = none.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    objective: ObjectiveConfig = Field(
        default_factory=PPOObjectiveConfig, description="Policy-gradient objective: ppo (token ratio, clipped), "
        "gspo (sequence ratio, clipped per sample) or cispo (clipped ratio as a stop-gradient weight)."
    )
    loss: LossConfig = Field(default_factory=GRPOLossConfig, description="Normalization and PPO clipping.")
    off_policy: OffPolicyConfig = Field(
        default_factory=TISConfig, description="Correction against the workers' sampling logprobs."
    )
    advantages: TrainerAdvantagesConfig = Field(
        default_factory=TrainerAdvantagesConfig, description="Which received samples the loss sees."
    )
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
    loss_chunk_mb: float = Field(
        8192,
        ge=0,
        description="MiB of float32 logits (rows x positions x vocabulary x 4 bytes) the loss works on at once: a "
        "micro-batch's above it are taken in chunks of positions, each recomputed in backward, so the loss needs "
        "about this instead of ~4 copies of the whole (its own time ~1.3x on CPU). 0: never in chunks.",
    )
    activation_checkpointing: bool = Field(
        False, description="Recompute each transformer block's activations in backward (less memory, ~30% more compute)."
    )
    compile: bool = Field(
        False,
        strict=True,
        description="torch.compile each transformer block's forward and the loss's per-token statistics: fewer, fused "
        "kernels where a step is bound by launching them (one rank on a GPU) or by passes over the logits. The first "
        "step, and the first micro-batch of a new length, wait seconds for a compilation. Dense models only.",
    )
    mixed_precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="bf16: FSDP2 computes in bf16, reduces gradients and keeps weights in fp32. auto: bf16 where "
        "the run's versions are bf16 (store.publish_dtype) and the device computes bf16 natively (CUDA, a CPU with "
        "AVX-512 bf16 or AMX), else fp32 (an AVX2 CPU emulates bf16 4-5x slower; decentrl/model/devices.py).",
    )
    checkpoint_every: int = Field(
        25, ge=1, description="Steps between resumable checkpoints under <run_dir>/trainer; the last step saves one too."
    )
    checkpoint_keep: int = Field(2, ge=1, description="Resumable checkpoints kept (older ones are deleted).")
    peer_timeout_s: float = Field(
        300.0, ge=5.0, le=86400.0,
        description="Several ranks: the longest any rank waits for the others in one collective. A node that dies, or "
        "a cut network between the nodes, stops every rank with an error saying so within this, instead of a hang; "
        "start the trainer again to resume from its checkpoint. Rank 0's waits for a batch or a publish do not count "
        "(heartbeats every quarter of it); raise it only for a collective that takes longer (a very large checkpoint).",
    )
    lora: LoRAConfig | None = Field(
        None, description="Present ([trainer.lora]): train a LoRA adapter on frozen base weights and publish only it."
    )
    seed: int = Field(0, ge=0, description="Seed of the trainer's RNG.")
    torch_threads: int = Field(1, ge=1, description="Intra-op CPU threads per rank.")
    gpu_memory: float | None = Field(
        None, gt=0, le=1, description="Share of its GPU's memory each rank may take on CUDA "
        "(torch.cuda.set_per_process_memory_fraction); None: no limit. `decentrl run` sets it from "
        "[placement] trainer.memory.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> TrainerConfig:
        if self.lr_warmup_steps >= self.steps:
            raise ValueError(
                f"trainer.lr_warmup_steps ({self.lr_warmup_steps}) must be smaller than trainer.steps ({self.steps})"
            )
        return self
