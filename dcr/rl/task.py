"""A verifiable symbol task with a programmatic reward.

Vocabulary: token ``BOS`` (0), token ``SEP`` (1) and ``symbols`` symbol tokens ``2 .. 2 + S - 1``.
A prompt is ``[BOS, s_1, ..., s_n, SEP]`` with ``n`` symbols drawn uniformly (with
replacement); the answer is the prompt's symbols sorted (``task="sort"``), copied or reversed,
and every response is exactly ``n`` tokens.  The reward is the fraction of positions where the
response holds the answer's token, so a random policy over a small vocabulary already earns
partial credit and the reward can climb within tens of steps from a randomly initialised model.

Everything random here is a pure function of integers through BLAKE2b, never of a library's
random number generator: the prompts of step ``k`` and each request's sampling seed are the
same on every machine and every version, so two runs of the RL loop (delta refits against
dense refits, say) see the same prompts and ask the engine for the same samples.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from dcr.errors import ConfigError
from dcr.rl.config import TASKS, RLConfig

__all__ = ["BOS", "SEP", "SymbolTask"]

BOS = 0
"""Beginning of every prompt."""
SEP = 1
"""Ends every prompt: the response starts after it."""
_FIRST_SYMBOL = 2


def _draw(*key: int) -> int:
    """A 64-bit integer determined by ``key`` (BLAKE2b of the integers' decimal text)."""
    text = ",".join(str(int(k)) for k in key).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8, person=b"dcr-rl-task").digest())


@dataclass(frozen=True, kw_only=True)
class SymbolTask:
    """Sort, copy or reverse ``length`` symbols of an alphabet of ``symbols`` tokens."""

    kind: str = "sort"
    symbols: int = 4
    length: int = 8

    def __post_init__(self) -> None:
        if self.kind not in TASKS:
            raise ConfigError(f"task {self.kind!r} is not one of {TASKS}", check="task")
        if self.symbols < 2 or self.length < 1:
            raise ConfigError("a task needs at least 2 symbols and 1 position", check="task")

    @classmethod
    def of(cls, config: RLConfig) -> SymbolTask:
        """The task ``config`` describes."""
        return cls(kind=config.task, symbols=config.symbols, length=config.prompt_symbols)

    @property
    def vocab_size(self) -> int:
        """BOS, SEP and the symbols."""
        return self.symbols + _FIRST_SYMBOL

    @property
    def prompt_len(self) -> int:
        """Tokens of every prompt."""
        return self.length + 2

    @property
    def response_len(self) -> int:
        """Tokens of every response."""
        return self.length

    def prompts(self, seed: int, step: int, n_prompts: int) -> list[list[int]]:
        """The ``n_prompts`` prompts of step ``step`` of the run seeded ``seed``.

        A pure function of its arguments; prompt ``i`` does not depend on ``n_prompts``.
        """
        out = []
        for i in range(n_prompts):
            body = [
                _FIRST_SYMBOL + _draw(0, seed, step, i, j) % self.symbols
                for j in range(self.length)
            ]
            out.append([BOS, *body, SEP])
        return out

    def answer(self, prompt: Sequence[int]) -> list[int]:
        """The response that earns reward 1 for ``prompt``."""
        body = self._body(prompt)
        if self.kind == "sort":
            return sorted(body)
        if self.kind == "reverse":
            return body[::-1]
        return body

    def reward(self, prompt: Sequence[int], response: Sequence[int]) -> float:
        """Fraction of the answer's positions the response gets right, in ``[0, 1]``.

        Tokens past the answer's length are ignored; missing ones count as wrong.
        """
        answer = self.answer(prompt)
        right = sum(1 for a, r in zip(answer, response, strict=False) if a == int(r))
        return right / len(answer)

    def sampling_seed(self, seed: int, step: int, prompt_index: int, sample_index: int) -> int:
        """The seed of one sampled completion (a non-negative 31-bit integer, which every
        engine accepts): completion ``sample_index`` of prompt ``prompt_index`` at ``step``."""
        return _draw(1, seed, step, prompt_index, sample_index) % (1 << 31)

    def _body(self, prompt: Sequence[int]) -> list[int]:
        tokens = [int(t) for t in prompt]
        if len(tokens) != self.prompt_len or tokens[0] != BOS or tokens[-1] != SEP:
            raise ConfigError(f"not a prompt of this task: {tokens}", check="prompt")
        body = tokens[1:-1]
        if any(not _FIRST_SYMBOL <= t < self.vocab_size for t in body):
            raise ConfigError(f"prompt holds a non-symbol token: {tokens}", check="prompt")
        return body
