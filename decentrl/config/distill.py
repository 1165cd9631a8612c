"""`[orchestrator.advantages.distill]`: on-policy distillation's per-token advantages.

Read where the orchestrator builds a batch (orchestrator/batches.py, decentrl/rl/advantages.py
`distill_advantages`). A teacher scorer (`[scorer] type = "teacher"`, workers/scorers/teacher.py)
posts the teacher's log-prob of every completion token of the student's own samples; each token's
advantage is the per-token reverse KL estimate, alone or with the group's outcome advantage
(docs/rewards.md, "On-policy distillation"). The checks that span sections (a model reward, no
step scores, a teacher scorer) are in decentrl/config/run.py.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from decentrl.config.base import Section


class DistillConfig(Section):
    """On-policy distillation (Agarwal et al. 2024, GKD, arXiv 2306.13649; Thinking Machines,
    "On-Policy Distillation", 2025): token t of sample i gets

        A_it = m_it * (weight * (clip(log p_teacher(y_t) - log p_student(y_t)) - b_t) + outcome_weight * A_i)

    with log p_student the sampling log-prob the worker posted, A_i the group's outcome advantage
    (`[orchestrator.advantages] type`) and m_it the loss mask. Minimizing the reverse KL
    KL(student || teacher) on the student's own samples is a policy gradient with that advantage.
    """

    type: Literal["reverse_kl"] = Field(
        "reverse_kl", description="The per-token signal: reverse_kl = teacher log-prob minus student log-prob of the "
        "sampled token (the one-sample estimate of -KL(student || teacher) at that position)."
    )
    weight: float = Field(
        1.0, gt=0.0, le=1000.0, allow_inf_nan=False, description="Weight of the teacher-minus-student log-prob in "
        "each token's advantage."
    )
    outcome_weight: float = Field(
        0.0, ge=0.0, le=1000.0, allow_inf_nan=False, description="Weight of the group's outcome advantage added to "
        "every token (0: distillation alone; > 0: distillation plus the task reward's RL signal)."
    )
    baseline: Literal["none", "group"] = Field(
        "none", description="none: the teacher-minus-student gap as it is (the papers, for a student that already "
        "writes plausible text); group: minus, at each token position, the group's mean gap there (the group's "
        "samples answer one prompt), so a token earns credit only for beating its siblings - less variance for a "
        "student that starts far from the teacher (docs/rewards.md)."
    )
    clip: float | None = Field(
        None, gt=0.0, le=1000.0, allow_inf_nan=False, description="Bound |teacher - student| log-prob of a token "
        "to this before weighting (a token the teacher finds near impossible otherwise dominates the batch); "
        "None: unbounded, as in the papers."
    )
