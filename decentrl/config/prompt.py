"""`[prompt]`: how a task's prompt becomes token ids (decentrl/tasks/prompts.py renders it).

Read by the orchestrator, which renders and tokenizes each prompt once and hands the ids to
workers with the lease (orchestrator/leases.py), and by `decentrl eval` (workers/evaluate.py),
which renders the same way.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from decentrl.config.base import Section


class PromptConfig(Section):
    """How a task's prompt becomes token ids; the orchestrator renders each prompt once and hands
    the ids to workers with the lease (decentrl/tasks/prompts.py)."""

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
