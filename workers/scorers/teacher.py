"""The `teacher` scorer backend: on-policy distillation's teacher, a causal LM directory that
answers the log-prob of every completion token (`token_logprobs`) and, as the score, exp(their
mean). Invariant: it scores exactly the ids the student sampled (no text is decoded or encoded
again), and only under the run's tokenizer (`vocabulary_problem`, checked at start-up).
"""

from __future__ import annotations

import math

from decentrl.api.wire import RunInfo, ScoreItem
from decentrl.config import TeacherScorerConfig
from decentrl.model.tokenizer import vocab_digest
from workers.scorers.base import BackendConfigError, Verdict, distilled, model_dtype, take_device


def vocabulary_problem(path: str, *, teacher_vocab: int, teacher_rows: int, teacher_digest: str, run: RunInfo) -> str | None:
    """Why a teacher cannot score this run's samples, or None: its tokenizer must be the run's (the
    same tokens under the same ids: `vocab_digest`), and its model must have a row for every id."""
    vocab_size, digest = distilled(run)
    if teacher_digest != digest:
        same = " (the same size, but other tokens or ids)" if teacher_vocab == vocab_size else ""
        return (
            f"teacher {path} has another tokenizer than the run {run.run_name!r}: its vocabulary has {teacher_vocab} "
            f"tokens, the run's (the student's) {vocab_size}{same}. On-policy distillation scores the student's "
            "token ids as they are: use a teacher with the student's tokenizer"
        )
    if teacher_rows < vocab_size:
        return (
            f"teacher {path} has {teacher_rows} rows in its embedding for a vocabulary of {vocab_size} tokens: "
            "every id the student may sample needs one"
        )
    return None


def item_problem(item: ScoreItem, max_length: int) -> str | None:
    """Why a teacher cannot score `item` (posted as a parse failure), or None."""
    prompt, completion = item.prompt_token_ids, item.completion_token_ids
    if prompt is None or completion is None:
        return "the item has no token ids: is the run distilling?"
    if not prompt or not completion:
        return f"{len(prompt)} prompt and {len(completion)} completion tokens: both need one"
    if len(prompt) + len(completion) > max_length:
        return f"{len(prompt) + len(completion)} tokens, over [scorer] max_length = {max_length}"
    return None


class TeacherBackend:
    def __init__(self, config: TeacherScorerConfig, run: RunInfo) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        assert config.path is not None, "a teacher with [scorer.server] is teacher_server.py's"
        path = config.path
        take_device(config.device, config.gpu_memory, config.torch_threads)
        self.config = config
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=model_dtype(config.dtype, config.device, path))
        rows = model.get_input_embeddings().num_embeddings
        problem = vocabulary_problem(
            path, teacher_vocab=len(tokenizer), teacher_rows=rows, teacher_digest=vocab_digest(tokenizer), run=run
        )
        if problem:
            raise BackendConfigError(problem)
        self.model = model.to(config.device).eval()
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0  # masked out anyway

    def score(self, items: list[ScoreItem]) -> list[Verdict]:
        problems = [item_problem(item, self.config.max_length) for item in items]
        verdicts = [None if problem is None else Verdict(None, error=problem) for problem in problems]
        scorable = [i for i, problem in enumerate(problems) if problem is None]
        # Like lengths together pad least.
        scorable.sort(key=lambda i: len(items[i].prompt_token_ids or ()) + len(items[i].completion_token_ids or ()))
        for start in range(0, len(scorable), self.config.batch_size):
            rows = scorable[start : start + self.config.batch_size]
            for i, logprobs in zip(rows, self.token_logprobs([items[i] for i in rows]), strict=True):
                verdicts[i] = Verdict(math.exp(sum(logprobs) / len(logprobs)), token_logprobs=logprobs)
        assert all(verdict is not None for verdict in verdicts), "every item is answered"
        return verdicts  # type: ignore[return-value]

    def token_logprobs(self, items: list[ScoreItem]) -> list[list[float]]:
        """The teacher's log-prob of each completion token of each item, one forward over the
        items right-padded (causal attention: a row's tokens never see the padding after them)."""
        import torch

        sequences = [[*(item.prompt_token_ids or ()), *(item.completion_token_ids or ())] for item in items]
        width = max(map(len, sequences))
        ids = torch.full((len(items), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(items), width), dtype=torch.long)
        for row, sequence in enumerate(sequences):
            ids[row, : len(sequence)] = torch.tensor(sequence)
            mask[row, : len(sequence)] = 1
        with torch.inference_mode():
            logits = self.model(input_ids=ids.to(self.config.device), attention_mask=mask.to(self.config.device), use_cache=False).logits
        result = []
        for row, item in enumerate(items):
            prompt, completion = len(item.prompt_token_ids or ()), item.completion_token_ids or []
            # Completion token t sits at position prompt + t and is predicted by the logits before it.
            predicting = logits[row, prompt - 1 : prompt + len(completion) - 1].float() / self.config.temperature  # (C, V)
            targets = torch.tensor(completion, device=predicting.device).unsqueeze(-1)  # (C, 1)
            chosen = predicting.log_softmax(-1).gather(-1, targets).squeeze(-1)  # (C,)
            result.append([min(value, 0.0) for value in chosen.tolist()])  # rounding never makes a log-prob > 0
        return result
