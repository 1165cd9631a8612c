"""Guess the number: a multi-turn task the tiny digit tokenizer can express.

Prompt: "99=" (guess a secret in 0..99). Each model turn is a guess ("42", then
end-of-sequence); the environment answers "1=" (the secret is higher), "2=" (lower) or "0=" (not
a number) and the episode ends when a guess is right or after `max_turns` guesses. Reward:
1 - (guesses - 1) / max_turns once found (1.0 at the first guess), 0 if never found. The secret
of each prompt is seeded, so the orchestrator's replay sees the same one as the worker.
"""

from __future__ import annotations

import random

from decentrl.config import GuessTaskConfig
from decentrl.tasks.base import Prompt
from decentrl.tasks.episodes import Answer, EpisodeTask

NOT_A_NUMBER, HIGHER, LOWER = "0=", "1=", "2="


class GuessEnvironment:
    def __init__(self, secret: int, max_turns: int) -> None:
        self.secret = secret
        self.max_turns = max_turns
        self.guesses = 0
        self.found_at: int | None = None

    def step(self, model_turn: str) -> Answer:
        self.guesses += 1
        guess = model_turn.strip()
        if not (guess.isascii() and guess.isdigit()):  # also "" (end-of-sequence at once), "4=", "²"
            return Answer(NOT_A_NUMBER, done=False)
        if int(guess) == self.secret:
            self.found_at = self.guesses
            return Answer("", done=True)
        return Answer(HIGHER if int(guess) < self.secret else LOWER, done=False)

    def reward(self) -> float:
        return 0.0 if self.found_at is None else 1.0 - (self.found_at - 1) / self.max_turns


class GuessTask(EpisodeTask):
    def __init__(self, config: GuessTaskConfig) -> None:
        self.max_number = config.max_number
        self.num_prompts = config.num_prompts
        self.max_turns = config.max_turns
        self.max_turn_tokens = len(str(config.max_number)) + 1  # the digits, then end-of-sequence
        rng = random.Random(config.seed)
        self._secrets = [rng.randint(0, config.max_number) for _ in range(config.num_prompts)]

    def prompt(self, prompt_id: int) -> Prompt:
        return Prompt(prompt_id=prompt_id, text=f"{self.max_number}=")

    def environment(self, prompt: Prompt) -> GuessEnvironment:
        return GuessEnvironment(self._secrets[prompt.prompt_id], self.max_turns)
