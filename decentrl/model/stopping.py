"""How a generation ends: at an end-of-sequence token, at a stop string, or at its token budget.

One definition for every side that must agree on it: the worker backends (workers/backends/)
cut a completion where `stop_cut` says; the orchestrator binds `ends_generation` to the run's
end-of-sequence ids, stop strings and decoder once (orchestrator/state.py) and checks with it a
single-turn rollout's finish_reason (orchestrator/checks.py) and every model turn of an episode
(decentrl/tasks/episodes.py `replay_episode`). Pure Python, no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Collection


def stop_cut(text_of: Callable[[list[int]], str], token_ids: list[int], stops: list[str], start: int = 0) -> int | None:
    """Length of `token_ids` up to and including the first token that completes a stop string.

    `start`: tokens before it were already checked (none of them completed a stop string).
    Only a window of the last tokens is decoded at each position: a stop string of L characters
    spans at most L tokens, plus a margin for tokens that decode to nothing (special tokens).
    """
    if not stops:
        return None
    window = max(len(stop) for stop in stops) + 8
    for end in range(start + 1, len(token_ids) + 1):
        text = text_of(token_ids[max(0, end - window) : end])
        if any(stop in text for stop in stops):
            return end
    return None


def ends_generation(
    token_ids: list[int], *, eos_ids: Collection[int], stops: list[str], text_of: Callable[[list[int]], str]
) -> bool:
    """Whether the last of `token_ids` ends a generation before its budget: an end-of-sequence
    id, or the token that completes a stop string (kept, as `stop_cut` keeps it: the string is in
    the text up to this token, not in the text up to the one before). `text_of` decodes without
    special tokens, as the backends do, so an end-of-sequence token adds no text."""
    if not token_ids:
        return False
    if token_ids[-1] in eos_ids:
        return True
    return stop_cut(text_of, token_ids, stops, start=max(0, len(token_ids) - 2)) == len(token_ids)


def eos_id_set(eos_token_id: int | list[int] | None) -> set[int]:
    """A generation config's `eos_token_id` (one id, several, or none) as a set."""
    return {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or [])
