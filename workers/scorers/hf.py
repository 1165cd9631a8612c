"""The `hf` scorer backend: a reward model (an AutoModelForSequenceClassification directory). Step
scores are the scores of the completion's prefixes ending at each step (`step_prefixes`); each text
is scored once (the last prefix is usually the whole completion).
"""

from __future__ import annotations

from decentrl.api.wire import ScoreItem
from decentrl.config import HFScorerConfig
from workers.scorers.base import BackendConfigError, Verdict, model_dtype, take_device


class HFScoreBackend:
    def __init__(self, config: HFScorerConfig) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        take_device(config.device, config.gpu_memory, config.torch_threads)
        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(config.path)
        self.tokenizer.truncation_side = config.truncation_side
        self.tokenizer.padding_side = "right"
        model = AutoModelForSequenceClassification.from_pretrained(
            config.path, dtype=model_dtype(config.dtype, config.device, config.path)
        )
        self.model = model.to(config.device).eval()
        labels = model.config.num_labels
        if labels == 1 and (config.label or 0) != 0:
            raise BackendConfigError(f"{config.path} has one label: leave [scorer] label out (it is {config.label})")
        if labels == 1 and config.transform == "softmax":
            raise BackendConfigError(f"{config.path} has one label: a softmax over it is always 1; use transform = 'logit' or 'sigmoid'")
        if labels > 1 and (config.label is None or config.label >= labels):
            raise BackendConfigError(
                f"{config.path} has {labels} labels: set [scorer] label to the one read as the score (0..{labels - 1})"
            )
        self.label = config.label or 0
        # Batches are padded, and the classifier reads each row at its last non-pad token: both
        # need a pad token, which many causal-LM tokenizers lack (their end of text serves).
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if model.config.pad_token_id is None:
            model.config.pad_token_id = self.tokenizer.pad_token_id
        if config.input == "chat" and self.tokenizer.chat_template is None:
            raise BackendConfigError(f"{config.path}: the tokenizer has no chat template; set [scorer] input = 'text'")

    def text(self, item: ScoreItem, completion: str) -> str:
        if self.config.input == "text":
            return item.prompt + completion
        messages = [m.model_dump() for m in item.messages] if item.messages else [{"role": "user", "content": item.prompt}]
        return self.tokenizer.apply_chat_template(
            [*messages, {"role": "assistant", "content": completion}], tokenize=False
        )

    def prefix_texts(self, item: ScoreItem) -> list[str] | None:
        """The texts of the item's step prefixes; None without steps, or when a step is not found."""
        cut = None if item.steps is None else step_prefixes(item.completion, item.steps)
        return None if cut is None else [self.text(item, prefix) for prefix in cut]

    def score_texts(self, texts: list[str]) -> list[float]:
        """Each text's score, `batch_size` per forward pass, like lengths together (they pad least)."""
        import torch

        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        scores = [0.0] * len(texts)
        for start in range(0, len(order), self.config.batch_size):
            rows = order[start : start + self.config.batch_size]
            encoded = self.tokenizer(
                [texts[i] for i in rows], padding=True, truncation=True, max_length=self.config.max_length,
                return_tensors="pt", add_special_tokens=self.config.input == "text",  # a chat template writes its own
            ).to(self.config.device)
            with torch.inference_mode():
                logits = self.model(**encoded).logits.float()  # (B, num_labels)
            if self.config.transform == "softmax":
                chosen = logits.softmax(-1)[:, self.label]
            elif self.config.transform == "sigmoid":
                chosen = logits[:, self.label].sigmoid()
            else:
                chosen = logits[:, self.label]
            for i, score in zip(rows, chosen.tolist(), strict=True):
                scores[i] = score
        return scores

    def score(self, items: list[ScoreItem]) -> list[Verdict]:
        wholes = [self.text(item, item.completion) for item in items]
        prefixes = [self.prefix_texts(item) for item in items]
        unique = list(dict.fromkeys([*wholes, *(text for texts in prefixes for text in texts or ())]))
        score_of = dict(zip(unique, self.score_texts(unique), strict=True))
        verdicts = []
        for item, whole, prefix_texts in zip(items, wholes, prefixes, strict=True):
            if item.steps is not None and prefix_texts is None:
                verdicts.append(Verdict(None, error="a step is not a piece of the completion (in order)"))
            else:
                steps = None if prefix_texts is None else [score_of[text] for text in prefix_texts]
                verdicts.append(Verdict(score_of[whole], steps))
        return verdicts


def step_prefixes(completion: str, steps: list[str]) -> list[str] | None:
    """The completion up to the end of each step, the steps found in order; None if one is not there."""
    prefixes, cursor = [], 0
    for step in steps:
        at = completion.find(step, cursor)
        if at < 0:
            return None
        cursor = at + len(step)
        prefixes.append(completion[:cursor])
    return prefixes
