"""The lease side of chat-template prompts: the orchestrator renders each prompt once with the
model's chat template (decentrl/tasks/prompts.py), hands the ids out with the lease, refuses a rollout
whose prompt ids differ, and counts the template's end-of-turn token as an end."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from decentrl.config import PretrainedModelConfig
from decentrl.model.build import end_of_sequence_ids, load_tokenizer
from decentrl.model.chat_model import IM_END
from decentrl.tasks import build_task
from orchestrator.state import RunState


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
    assert (
        text
        == f"<|im_start|>system\nSort.<|im_end|>\n<|im_start|>user\n{state.task.prompt(lease.prompt_id).text}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
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
