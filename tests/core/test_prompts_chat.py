"""Chat-template prompts (decentrl/tasks/prompts.py): the locally trained byte-level BPE tokenizer with
its ChatML template, system prompt and template options, raw prompts for base models, and a
template that fails at start-up. The lease side is tests/orchestrator/test_orchestrator_prompts.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from decentrl.config import PromptConfig
from decentrl.model.chat_model import IM_END
from decentrl.tasks import Prompt
from decentrl.tasks.prompts import PromptError, make_prompt_encoder


@pytest.fixture(scope="module")
def chat_tokenizer(chat_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(chat_dir)


class OnePrompt:
    num_prompts = 1

    def __init__(self, prompt: Prompt) -> None:
        self._prompt = prompt

    def prompt(self, prompt_id: int) -> Prompt:
        return self._prompt


def test_the_tokenizer_is_byte_level_bpe_with_chatml(chat_dir: Path, chat_tokenizer: PreTrainedTokenizerBase) -> None:
    assert chat_tokenizer.decode(chat_tokenizer("héllo wörld ☃").input_ids) == "héllo wörld ☃"  # any bytes
    assert chat_tokenizer.eos_token == IM_END
    assert len(chat_tokenizer) == 259  # 256 bytes + 3 specials: CHAT_TEXTS are digits and '=', and digits never merge
    digits = [t for t in chat_tokenizer.tokenize("0123=4567 = 89") if any(c.isdigit() for c in t)]
    assert digits == list("0123456789")  # every digit its own token, as Qwen2.5's tokenizer splits numbers
    rendered = chat_tokenizer.apply_chat_template([{"role": "user", "content": "12="}], tokenize=False, add_generation_prompt=True)
    assert rendered == "<|im_start|>user\n12=<|im_end|>\n<|im_start|>assistant\n"


def test_rendering_system_prompt_and_template_options(chat_tokenizer: PreTrainedTokenizerBase) -> None:
    prompt = Prompt(0, "3141=")
    config = PromptConfig(system="Sort.", template_options={"enable_thinking": False})
    ids = make_prompt_encoder(config, chat_tokenizer, OnePrompt(prompt))(prompt)
    assert chat_tokenizer.decode(ids) == (
        "<|im_start|>system\nSort.<|im_end|>\n<|im_start|>user\n3141=<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    messages = Prompt(0, "x", messages=(("system", "Own."), ("user", "2+2?")))
    ids = make_prompt_encoder(config, chat_tokenizer, OnePrompt(messages))(messages)
    assert chat_tokenizer.decode(ids).startswith("<|im_start|>system\nOwn.<|im_end|>\n<|im_start|>user\n2+2?")  # task's own system kept
    raw = make_prompt_encoder(PromptConfig(format="raw"), chat_tokenizer, OnePrompt(prompt))(prompt)
    assert chat_tokenizer.decode(raw) == "3141="  # base models keep raw prompts


def test_a_template_that_fails_to_render_fails_at_start_up(chat_dir: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    broken = AutoTokenizer.from_pretrained(chat_dir)
    broken.chat_template = "{{ raise_exception('only user messages') if messages[0]['role'] == 'system' }}"
    with pytest.raises(PromptError, match=r"prompt 0: the chat template of .* failed to render it .*only user messages"):
        make_prompt_encoder(PromptConfig(system="no"), broken, OnePrompt(Prompt(0, "1=")))
    with pytest.raises(PromptError, match="prompt.format = 'chat' but the model's tokenizer has no chat template"):
        make_prompt_encoder(PromptConfig(format="chat"), tokenizer, OnePrompt(Prompt(0, "1=")))
