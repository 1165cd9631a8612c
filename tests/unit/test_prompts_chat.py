"""Chat-template prompts: the locally trained byte-level BPE tokenizer with its ChatML template,
rendered once by the orchestrator and handed out with the lease; a worker cannot change them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from decentrl.chat_model import IM_END, ChatModelSpec, write_chat_model
from decentrl.config import PretrainedModelConfig, PromptConfig
from decentrl.model import end_of_sequence_ids, load_tokenizer
from decentrl.prompts import PromptError, make_prompt_encoder
from decentrl.tasks import Prompt, build_task
from orchestrator.state import RunState
from workers.evaluate import pass_at_k, pass_at_k_table

TEXTS = [f"{a}{b}{c}{d}=" for a in "0123" for b in "4567" for c in "89" for d in "0123"]


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_chat_model(TEXTS, str(tmp_path_factory.mktemp("chat")), ChatModelSpec(vocab_size=270, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64))


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
    assert len(chat_tokenizer) == 270
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


def test_the_lease_carries_the_rendered_ids_and_a_worker_cannot_change_them(
    chat_dir: Path, make_config: Any, make_rollout: Any, clock: Any
) -> None:
    config = make_config(prompt={"system": "Sort."})
    config = config.model_copy(update={"model": PretrainedModelConfig(path=str(chat_dir))})
    tokenizer = load_tokenizer(config.model)
    state = RunState(config=config, task=build_task(config.task), tokenizer=tokenizer, clock=clock)
    state.announce(0)
    lease, other = state.grant_leases("alice/w0", 2)
    text = tokenizer.decode(lease.prompt_token_ids)
    assert text == f"<|im_start|>system\nSort.<|im_end|>\n<|im_start|>user\n{state.task.prompt(lease.prompt_id).text}<|im_end|>\n<|im_start|>assistant\n"
    # The completion ends at the template's end-of-turn token, which the orchestrator counts as an end.
    end_of_turn = tokenizer.convert_tokens_to_ids(IM_END)
    assert end_of_turn in end_of_sequence_ids(config.model, tokenizer)
    answer = "".join(sorted(state.task.prompt(lease.prompt_id).text.rstrip("=")))
    completion = tokenizer(answer, add_special_tokens=False).input_ids + [end_of_turn]
    raw_prompt = tokenizer(state.task.prompt(lease.prompt_id).text).input_ids  # the prompt without the template
    tampered = make_rollout(lease, completion, prompt_token_ids=raw_prompt)
    result = state.ingest([tampered], "alice/w0")
    assert result.accepted == 0 and result.rejected[0].reason == "prompt_mismatch"
    honest = [make_rollout(lease, completion) for _ in range(lease.group_size)]
    assert state.ingest(honest, "alice/w0").accepted == lease.group_size
    assert [reward for _, reward in state.ready[0].samples] == [1.0] * lease.group_size


def test_pass_at_k() -> None:
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25) and pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(4, 1, 4) == 1.0 and pass_at_k(4, 3, 2) == 1.0
    table = pass_at_k_table([1.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.0, 0.0], samples=4)
    assert table == {"pass@1": pytest.approx(0.125), "pass@2": pytest.approx(0.25), "pass@4": pytest.approx(0.5)}
