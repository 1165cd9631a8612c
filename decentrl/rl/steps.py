"""Steps of a completion, for process rewards: where each step ends (a completion token index) and its text.

The orchestrator calls `split_steps` for each sample of a task scored per step: it sends the step
texts to a scorer, which returns one score per step, and `decentrl/rl/advantages.py`
`process_advantages` turns the scores into per-token advantages by the step ends. How a completion
is split is `[orchestrator.advantages.steps]` (docs/rewards.md#process-rewards):

- `delimiter`: the completion's text (decoded as the orchestrator scores it) is cut at each run of
  the delimiter ("\\n\\n" by default; a run of repeats counts once). A step ends at the token whose
  text completes the run, i.e. the first token t for which decode(ids[: t + 1]) holds all of it.
  The last step always ends at the last token, so end-of-sequence tokens (which decode to nothing)
  belong to it. A step's text leaves out the delimiter run that ends it and surrounding whitespace
  (the third newline of "\\n\\n\\n" with the delimiter "\\n\\n").
- `turns` (multi-turn episodes): each run of loss_mask = 1 tokens (one model turn) is a step; the
  environment's tokens between turns belong to no step (they are not trained).

Both keep at most `max_steps` steps: past it, the rest of the completion is the last step.

Finding the token that ends a step decodes prefixes of the completion: a guess from the text each
token adds after its predecessor, checked by decoding two prefixes per step boundary (one batch
decode for all of them), and where the guess is wrong a bisection (one batch decode per round).
Any tokenizer works (no per-token offsets needed) as long as decoding a longer prefix extends the
text of a shorter one, which holds for the byte-level BPE and SentencePiece tokenizers; where it
does not, a boundary that is never found falls into the last step. Cost: docs/rewards.md#steps.
"""

from __future__ import annotations

import bisect
import itertools
import re
from collections.abc import Callable
from dataclasses import dataclass

from decentrl.config import DelimiterStepsConfig, StepsConfig, TurnStepsConfig

# tokenizer.batch_decode(sequences, skip_special_tokens=True): orchestrator/tokenizer.py `make_decoder`.
BatchDecode = Callable[[list[list[int]]], list[str]]


@dataclass(frozen=True)
class Steps:
    """A completion's steps: `ends[j]` is the index of step j's last completion token (strictly
    increasing, within the completion), `texts[j]` its text (what a scorer is shown)."""

    ends: list[int]
    texts: list[str]


def split_steps(
    completion_token_ids: list[int], loss_mask: list[int] | None, *, decode: BatchDecode, config: StepsConfig
) -> Steps:
    """The completion's steps, split as `config` says (module docstring); at least one step."""
    if isinstance(config, TurnStepsConfig):
        return turn_steps(completion_token_ids, loss_mask, decode=decode, max_steps=config.max_steps)
    return delimiter_steps(completion_token_ids, decode=decode, config=config)


def delimiter_steps(completion_token_ids: list[int], *, decode: BatchDecode, config: DelimiterStepsConfig) -> Steps:
    """Steps cut at runs of `config.delimiter` in the decoded completion (module docstring)."""
    ids = list(completion_token_ids)
    last = len(ids) - 1
    (text,) = decode([ids])
    runs = [(m.start(), m.end()) for m in re.finditer(f"(?:{re.escape(config.delimiter)})+", text)]
    content_start, content_end = 0, len(text)
    if runs and runs[0][0] == 0:  # a leading delimiter closes no step
        content_start = runs.pop(0)[1]
    if runs and runs[-1][1] == len(text):  # nor does a trailing one: the last step ends at the last token
        content_end = runs.pop()[0]
    runs = runs[: config.max_steps - 1]
    tokens = _tokens_completing(ids, [text[:end] for _, end in runs], decode)
    # A run completed only by the last token closes the last step; runs completed by one token
    # close one step (the latest run's). From the end, so the ends come out strictly increasing.
    kept: list[tuple[tuple[int, int], int]] = []
    bound = last
    for run, token in reversed(list(zip(runs, tokens, strict=True))):
        if token < bound:
            kept.insert(0, (run, token))
            bound = token
    ends, texts, start = [], [], content_start
    for (run_start, run_end), token in kept:
        ends.append(token)
        texts.append(text[start:run_start].strip())
        start = run_end
    ends.append(last)
    texts.append(text[start:content_end].strip())
    return Steps(ends, texts)


def _tokens_completing(ids: list[int], prefixes: list[str], decode: BatchDecode) -> list[int]:
    """For each text prefix, the first token index t with decode(ids[: t + 1]) starting with it
    (len(ids) - 1 or more when none does).

    A first guess from the length each token adds to the text after its predecessor (exact where
    decode joins token texts, as byte-level BPE does, and where it only drops the text's leading
    space, as SentencePiece does), checked with the guess and the token before it; a guess that
    fails narrows the range that bisections, all in lock-step (one batch decode per round), then search.
    """
    texts = decode([[token] for token in ids] + [ids[k - 1 : k + 1] for k in range(1, len(ids))])
    singles, pairs = texts[: len(ids)], texts[len(ids) :]
    added = [len(singles[0])] + [len(pair) - len(single) for pair, single in zip(pairs, singles, strict=False)]
    ends = list(itertools.accumulate(added))
    low = [0] * len(prefixes)
    high = [len(ids) - 1] * len(prefixes)  # invariant: the answer is in [low, high]
    probes = []
    for i, prefix in enumerate(prefixes):
        guess = min(bisect.bisect_left(ends, len(prefix)), len(ids) - 1)
        probes += [(i, guess), (i, guess - 1)] if guess else [(i, guess)]
    while probes:
        for (i, mid), decoded in zip(probes, decode([ids[: mid + 1] for _, mid in probes]), strict=True):
            if decoded.startswith(prefixes[i]):
                high[i] = min(high[i], mid)
            else:
                low[i] = max(low[i], mid + 1)
        probes = [(i, (low[i] + high[i]) // 2) for i in range(len(prefixes)) if low[i] < high[i]]
    return low


def turn_steps(completion_token_ids: list[int], loss_mask: list[int] | None, *, decode: BatchDecode, max_steps: int) -> Steps:
    """One step per model turn (run of loss_mask = 1); no mask, or no model token: one step of it all."""
    ids = list(completion_token_ids)
    runs: list[list[int]] = []  # [first, last] token of each turn
    for t, m in enumerate(loss_mask or []):
        if m and runs and runs[-1][1] == t - 1:
            runs[-1][1] = t
        elif m:
            runs.append([t, t])
    if not runs:
        runs = [[0, len(ids) - 1]]
    if len(runs) > max_steps:  # the rest is the last step, environment tokens between its turns included
        runs = runs[: max_steps - 1] + [[runs[max_steps - 1][0], runs[-1][1]]]
    texts = decode([ids[first : last + 1] for first, last in runs])
    return Steps([last for _, last in runs], texts)
