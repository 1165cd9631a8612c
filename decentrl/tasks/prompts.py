"""Prompt rendering: a task's prompt -> the token ids every role agrees on.

The orchestrator renders and tokenizes each prompt once (orchestrator/leases.py `PromptQueue`) and hands the ids
to workers with the lease; a rollout whose prompt ids differ is rejected (`prompt_mismatch`), so
workers, the reward and the trainer see the same prompt token for token. `decentrl eval` renders
with the same function. With a chat template, the prompt is a system message (optional) and the
user's message (or the task's own messages), with the generation prompt appended; the template's
end-of-turn token ends a generation because a chat model's generation config lists it among its
end-of-sequence ids (decentrl/model/build.py `end_of_sequence_ids`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from decentrl.config import PromptConfig
from decentrl.tasks.base import Prompt

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from decentrl.tasks.base import Task
    from decentrl.tasks.episodes import EpisodeTask


PromptEncoder = Callable[[Prompt], list[int]]


class PromptError(ValueError):
    """A prompt that cannot be rendered; the message names the prompt and what to fix."""


def chat_template(config: PromptConfig, tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The chat template prompts render with: prompt.template_file's text, else the tokenizer's own."""
    if config.template_file is None:
        return tokenizer.chat_template
    try:
        return Path(config.template_file).read_text()
    except OSError as exc:
        raise PromptError(
            f"prompt.template_file = {config.template_file!r}: cannot read it ({exc.strerror or exc}); "
            "give a Jinja chat template file that exists on this machine"
        ) from None


def uses_chat(config: PromptConfig, tokenizer: PreTrainedTokenizerBase) -> bool:
    template = chat_template(config, tokenizer)
    if config.format == "chat" and not template:
        raise PromptError(
            "prompt.format = 'chat' but the model's tokenizer has no chat template and prompt.template_file "
            "is not set: set prompt.template_file to a Jinja chat template file, or prompt.format = 'raw'"
        )
    return config.format == "chat" or (config.format == "auto" and bool(template))


def chat_messages(config: PromptConfig, prompt: Prompt) -> list[dict[str, str]]:
    messages = list(prompt.messages) if prompt.messages is not None else [("user", prompt.text)]
    if config.system is not None and messages[0][0] != "system":
        messages.insert(0, ("system", config.system))
    return [{"role": role, "content": content} for role, content in messages]


def make_prompt_encoder(
    config: PromptConfig, tokenizer: PreTrainedTokenizerBase, task: Task | EpisodeTask,
    raw: Callable[[str], list[int]] | None = None,
) -> PromptEncoder:
    """prompt -> token ids; renders the task's first prompt now, so a template that fails does so
    at start-up (prompt.template_file is read now, so a missing one fails then too). `raw`: a faster
    equivalent of `tokenizer(text).input_ids` for raw prompts."""
    if uses_chat(config, tokenizer):
        template = chat_template(config, tokenizer)  # read once: a template file is not re-read per prompt

        def encode(prompt: Prompt) -> list[int]:
            try:
                text = tokenizer.apply_chat_template(
                    chat_messages(config, prompt), chat_template=template, tokenize=False, add_generation_prompt=True,
                    **config.template_options,
                )
            except Exception as exc:  # jinja raises many kinds; each becomes one clear message
                raise PromptError(
                    f"prompt {prompt.prompt_id}: the chat template of {tokenizer.name_or_path or 'the tokenizer'} "
                    f"failed to render it ({type(exc).__name__}: {exc}); check prompt.system, prompt.template_options "
                    "and the task's messages"
                ) from None
            # The template writes its own special tokens (e.g. <|im_start|>): add none on top.
            return tokenizer(text, add_special_tokens=False).input_ids
    else:
        def encode(prompt: Prompt) -> list[int]:
            return raw(prompt.text) if raw is not None else tokenizer(prompt.text).input_ids

    if task.num_prompts:
        encode(task.prompt(0))
    return encode
