"""The symbol task: prompts and sampling seeds are pure functions of (seed, step), rewards give
partial credit; and the RL config's checks."""

from __future__ import annotations

import pytest

from dcr.errors import ConfigError
from dcr.rl.config import RLConfig
from dcr.rl.task import BOS, SEP, SymbolTask


def test_prompts_are_a_pure_function_of_seed_and_step() -> None:
    task = SymbolTask()
    assert task.prompts(0, 0, 8) == task.prompts(0, 0, 8)
    assert task.prompts(0, 0, 8) == SymbolTask().prompts(0, 0, 8)  # a fresh object: same
    assert task.prompts(0, 0, 8)[:3] == task.prompts(0, 0, 3)  # prompt i ignores n_prompts
    assert task.prompts(0, 1, 8) != task.prompts(0, 0, 8)
    assert task.prompts(1, 0, 8) != task.prompts(0, 0, 8)
    # Pinned: the draw is BLAKE2b of the integers, the same on every machine and version.
    assert task.prompts(0, 0, 2) == [[0, 4, 5, 5, 3, 5, 5, 4, 5, 1], [0, 5, 3, 3, 3, 3, 2, 4, 3, 1]]
    assert SymbolTask(kind="reverse", symbols=16, length=5).prompts(1, 2, 2) == [
        [0, 12, 4, 14, 3, 2, 1],
        [0, 16, 4, 3, 15, 17, 1],
    ]


def test_prompts_are_well_formed_and_cover_the_alphabet() -> None:
    task = SymbolTask(symbols=6, length=5)
    prompts = [p for step in range(20) for p in task.prompts(3, step, 8)]
    assert all(len(p) == task.prompt_len == 7 for p in prompts)
    assert all(p[0] == BOS and p[-1] == SEP for p in prompts)
    symbols = {t for p in prompts for t in p[1:-1]}
    assert symbols == set(range(2, 8)) and task.vocab_size == 8


def test_sampling_seeds_are_deterministic_distinct_and_31_bit() -> None:
    task = SymbolTask()
    seeds = [task.sampling_seed(5, k, i, j) for k in range(3) for i in range(8) for j in range(8)]
    assert seeds == [
        task.sampling_seed(5, k, i, j) for k in range(3) for i in range(8) for j in range(8)
    ]
    assert len(set(seeds)) == len(seeds)
    assert all(0 <= s < 2**31 for s in seeds)
    assert task.sampling_seed(0, 0, 0, 0) == 1728294874


def test_answers_and_partial_credit() -> None:
    prompt = [BOS, 5, 2, 4, 2, SEP]
    sort = SymbolTask(kind="sort", symbols=4, length=4)
    copy = SymbolTask(kind="copy", symbols=4, length=4)
    reverse = SymbolTask(kind="reverse", symbols=4, length=4)
    assert sort.answer(prompt) == [2, 2, 4, 5]
    assert copy.answer(prompt) == [5, 2, 4, 2]
    assert reverse.answer(prompt) == [2, 4, 2, 5]
    assert sort.reward(prompt, [2, 2, 4, 5]) == 1.0
    assert sort.reward(prompt, [2, 3, 4, 3]) == 0.5
    assert sort.reward(prompt, [5, 4, 2, 2]) == 0.0
    assert sort.reward(prompt, [2, 2]) == 0.5  # missing positions count as wrong
    assert sort.reward(prompt, [2, 2, 4, 5, 0, 1]) == 1.0  # tokens past the answer: ignored
    assert sort.reward(prompt, [SEP, 2, 4, 5]) == 0.75


def test_a_uniform_policy_earns_partial_credit() -> None:
    task = SymbolTask()
    prompts = task.prompts(0, 0, 64)
    # Expected reward of a uniform choice over the whole vocabulary: 1 / vocab_size.
    total = sum(task.reward(p, [t] * task.length) for p in prompts for t in range(task.vocab_size))
    mean = total / (len(prompts) * task.vocab_size)
    assert mean == pytest.approx(1 / task.vocab_size)
    assert mean > 0.15


@pytest.mark.parametrize(
    "prompt",
    [[BOS, 2, 3, 4, 5], [BOS, 2, 3, 4, 5, 1, 1], [1, 2, 3, 4, 5, SEP], [BOS, 2, 6, 4, 5, SEP]],
)
def test_malformed_prompts_are_refused(prompt: list[int]) -> None:
    with pytest.raises(ConfigError, match="prompt"):
        SymbolTask(symbols=4, length=4).answer(prompt)


def test_config_derives_the_task_and_checks_its_fields() -> None:
    config = RLConfig()
    task = SymbolTask.of(config)
    assert (task.kind, task.symbols, task.length) == (
        config.task,
        config.symbols,
        config.prompt_symbols,
    )
    assert config.vocab_size == task.vocab_size
    assert (config.prompt_len, config.response_len) == (task.prompt_len, task.response_len)
    assert config.batch_size == config.prompts_per_step * config.group_size
    assert RLConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ConfigError, match="unknown"):
        RLConfig.from_dict({**config.to_dict(), "dropout": 0.1})
    for bad in (
        {"task": "add"},
        {"head_dim": 16},
        {"group_size": 1},
        {"num_heads": 3, "num_kv_heads": 2},
        {"clip_eps": 1.5},
        {"beta": -1.0},
        {"lr": 0.0},
    ):
        with pytest.raises(ConfigError):
            RLConfig(**bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        RLConfig(4)  # type: ignore[misc]
