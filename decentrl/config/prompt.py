"""`[prompt]`: how a task's prompt becomes token ids (decentrl/tasks/prompts.py renders it).

Read by the orchestrator, which renders and tokenizes each prompt once and hands the ids to
workers with the lease (orchestrator/leases.py), and by `decentrl eval` (workers/evaluate.py),
which renders the same way.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from decentrl.config.base import Section


class PromptConfig(Section):
    """How a task's prompt becomes token ids; the orchestrator renders each prompt once and hands
    the ids to workers with the lease (decentrl/tasks/prompts.py)."""

    format: Literal["auto", "chat", "raw"] = Field(
        "auto",
        description="chat: render with the tokenizer's chat template; raw: the prompt text as is (base models); "
        "auto: chat when there is a chat template (template_file, else the tokenizer's).",
    )
    template_file: str | None = Field(
        None, min_length=1,
        description="A Jinja chat template file (as in an HF tokenizer's chat_template.jinja), used instead of the "
        "tokenizer's: for a model that carries none. Read at start-up by the roles that render prompts (the "
        "orchestrator, `decentrl eval`); a relative path is taken from the directory they start in.",
    )
    system: str | None = Field(None, max_length=100_000, description="A system message put before every prompt.")
    template_options: dict[str, object] = Field(
        default_factory=dict,
        description="Extra variables for the chat template, e.g. {enable_thinking = false} for Qwen3.",
    )

    @model_validator(mode="after")
    def _template_is_used(self) -> PromptConfig:
        if self.template_file is not None and self.format == "raw":
            raise ValueError("prompt.template_file is set but prompt.format = 'raw' renders no template: "
                             "drop template_file, or set format = 'chat' (or 'auto')")
        return self
