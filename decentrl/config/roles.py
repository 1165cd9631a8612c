"""`[orchestrator.roles]`: units whose nodes have roles (co-evolution, issue 48).

Read by the orchestrator's lease policy (orchestrator/roles.py) and reward stage
(orchestrator/reward_stage.py `RolesRewards`): each lease is a unit of a proposer node (one
sample, the lease's prompt) and a solver node the orchestrator derives from the proposer's
sample, leased as sub-leases of `sub_lease_size` samples to any worker as it frees up
(docs/architecture.md, "The unit of work, widened"). The task must have roles (`[task] type =
"propose"`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from decentrl.config.base import Section


class RolesConfig(Section):
    solvers: int = Field(8, ge=1, le=1024, description="Samples of a unit's solver node (G: the solver answers per proposal).")
    sub_lease_size: int = Field(
        8, ge=1, le=1024, description="Solver samples one sub-lease holds: the node's fan-out to workers as they free up "
        "(solvers / sub_lease_size sub-leases a node)."
    )
    min_fill: int = Field(
        8, ge=1, le=1024, description="The straggler bound: a solver node holding at least this many samples closes short "
        "once close_after_s has passed since it was made; its late samples are refused node_closed and counted."
    )
    close_after_s: float = Field(
        30.0, gt=0, le=86400, description="Seconds after a solver node is made before it may close short (at min_fill)."
    )
    policies: Literal["shared", "per_role"] = Field(
        "shared", description="'shared': one model plays both roles with role prompts (one trainer, one stream of "
        "versions). 'per_role': each role is its own model (policy, named as the role), with its own trainer "
        "(trainer.policy) publishing its own stream of versions under <store url>/<policy>/, its own batches "
        "(GET /v1/batch?policy=) and staleness; each worker serves one policy (worker.policy).",
    )
    holder_first_s: float = Field(
        0.0, ge=0, le=3600, description="Seconds a new solver node's sub-leases wait for the unit's own holder before any "
        "worker may take them (0: any worker, as it frees up)."
    )

    @property
    def policy_names(self) -> tuple[str, ...]:
        """The run's policies, named by their roles; () when one shared policy plays both."""
        return ("proposer", "solver") if self.policies == "per_role" else ()

    @model_validator(mode="after")
    def _fits(self) -> RolesConfig:
        if self.min_fill > self.solvers:
            raise ValueError(
                f"orchestrator.roles.min_fill ({self.min_fill}) exceeds solvers ({self.solvers}): a node could never close; "
                "lower min_fill"
            )
        if self.sub_lease_size > self.solvers:
            raise ValueError(
                f"orchestrator.roles.sub_lease_size ({self.sub_lease_size}) exceeds solvers ({self.solvers}): lower it"
            )
        return self
