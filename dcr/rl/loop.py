"""The RL loop of one trainer rank: rollouts -> GRPO step -> refit -> next step.

Every rank of the FSDP2 trainer runs :func:`run_rank`.  Rank 0 asks the rollout engine for
the step's batch (every prompt's completions, submitted together, each request with its own
seed), checks that every completion came from the version the schedule names, stores the
batch and broadcasts it to the other ranks; every rank then takes one optimizer step, saves
the trainer's state, and the new version is refitted into the engine:

* ``delta`` -- through dcr: the rank's owner publishes its shards (:func:`dcr.join_trainer`),
  and ``publish`` returns once every receiver applied the changes and the version committed;
* ``dense`` -- the reference: the ranks write the full checkpoint and the engine loads it
  through vLLM's own ``load_weights``.

Versions: version ``k`` is the policy after step ``k`` (version 0: the initial checkpoint).
Synchronous mode trains step ``k`` on rollouts of version ``k - 1``.  Asynchronous mode
trains step ``k`` on rollouts of version ``k - 2`` (staleness 1): rank 0 submits the next
step's batch *before* the refit of the version it just trained starts, so the engine
generates it on the weights it holds while the refit streams, and the gate closes (waiting
for those requests) only to apply and commit.  The schedule is fixed, never a race, so two
runs with the same seed see the same rollouts whatever their refits cost.

Restarts: a rank resumes from its saved state of the committed version (the fleet's commit
record, or the last version the dense engine loaded).  Rank 0 stores every batch it trained
on (``<state_dir>/rollouts``) before training on it, so the step in flight when the trainer
died is recomputed from the same rollouts, without asking the engine (which may hold a
partially applied version until the step is published again).

Rank 0 reports each step as events of its own (``rl-step`` after the optimizer step,
``rl-refit`` once the version is live in the engine) for ``dcr rl`` to show and collect.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import anyio

from dcr.errors import ConfigError
from dcr.fleet.eventlog import EventLog
from dcr.rl.config import RLConfig
from dcr.rl.engine import EngineClient, tokens_digest
from dcr.rl.files import atomic_write
from dcr.tensors.fp8 import Fp8Scheme

__all__ = [
    "MODES",
    "REFITS",
    "ROLLOUT_DTYPES",
    "Batches",
    "RunSpec",
    "restore",
    "rollout_version",
    "run_rank",
]

REFITS = ("delta", "dense")
MODES = ("sync", "async")
ROLLOUT_DTYPES = ("bf16", "fp8")


@dataclass(frozen=True, slots=True, kw_only=True)
class RunSpec:
    """One RL run, as every trainer rank sees it (JSON in ``[trainer.options]``)."""

    steps: int
    seed: int = 0
    mode: str = "sync"
    max_staleness: int = 1
    refit: str = "delta"
    checkpoint: str
    """Version 0's Hugging Face checkpoint directory."""
    engine_ready: str
    """The ready file the engine process writes (its URL)."""
    state_dir: str
    """The trainer's own state: saved versions, stored rollout batches."""
    events_dir: str
    rl: dict[str, Any] = field(default_factory=dict)
    """:class:`~dcr.rl.config.RLConfig` fields."""
    rollout_dtype: str = "bf16"
    """What the engine serves: ``bf16`` (the trainer's weights) or ``fp8`` (their FP8 export:
    dense refits quantize each version's checkpoint with ``fp8_block``)."""
    fp8_block: int | None = None
    """FP8 scale tiles (``block x block``), ``None``: one scale per output channel."""

    def __post_init__(self) -> None:
        if self.rollout_dtype not in ROLLOUT_DTYPES:
            raise ConfigError(
                f"rollout_dtype must be one of {ROLLOUT_DTYPES}, got {self.rollout_dtype!r}"
            )
        _ = self.fp8
        if self.refit not in REFITS:
            raise ConfigError(f"refit must be one of {REFITS}, got {self.refit!r}")
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.steps < 1:
            raise ConfigError(f"steps must be at least 1, got {self.steps}")
        if self.mode == "async" and self.max_staleness < 1:
            raise ConfigError(
                "asynchronous mode generates a step's rollouts while the previous version "
                "streams: it needs --max-staleness 1 or more"
            )
        if self.max_staleness < 0:
            raise ConfigError("max_staleness must not be negative")
        RLConfig.from_dict(dict(self.rl))

    @property
    def config(self) -> RLConfig:
        return RLConfig.from_dict(dict(self.rl))

    @property
    def fp8(self) -> Fp8Scheme | None:
        """The FP8 scheme the engine serves, ``None`` for BF16."""
        return Fp8Scheme(self.fp8_block) if self.rollout_dtype == "fp8" else None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> RunSpec:
        try:
            return cls(**raw)
        except TypeError as exc:
            raise ConfigError(f"malformed RL run options: {exc}") from exc


def rollout_version(spec: RunSpec, step: int) -> int:
    """The version whose weights generate step ``step``'s rollouts."""
    lag = 1 if spec.mode == "async" else 0
    return max(0, step - 1 - lag)


class Batches:
    """Rank 0's store of the batches it trained on, one JSON file per step (atomic)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def path(self, step: int) -> Path:
        return self.directory / f"step-{step:06d}.json"

    def get(self, step: int) -> dict[str, Any] | None:
        try:
            data: dict[str, Any] = json.loads(self.path(step).read_text())
        except (OSError, ValueError):
            return None
        return data if data.get("step") == step else None

    def put(self, batch: dict[str, Any]) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        atomic_write(self.path(int(batch["step"])), json.dumps(batch).encode())


def _requests(spec: RunSpec, step: int) -> tuple[list[list[int]], list[dict[str, Any]]]:
    """Step ``step``'s prompts and the engine requests: ``group_size`` seeded samples of each
    prompt, group-major."""
    from dcr.rl.task import SymbolTask

    cfg = spec.config
    task = SymbolTask.of(cfg)
    prompts = task.prompts(spec.seed, step, cfg.prompts_per_step)
    requests = [
        {
            "prompt_token_ids": prompt,
            "max_tokens": cfg.response_len,
            "temperature": cfg.temperature,
            "top_p": 1.0,
            "seed": task.sampling_seed(spec.seed, step, i, j),
            "ignore_eos": True,
        }
        for i, prompt in enumerate(prompts)
        for j in range(cfg.group_size)
    ]
    return prompts, requests


def _fetch(
    spec: RunSpec,
    engine: EngineClient,
    step: int,
    say: Callable[[str], None],
    *,
    accepted: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Rank 0: step ``step``'s batch from the engine, every completion of the scheduled
    version, with rewards; ``accepted`` is called once the engine holds the batch."""
    from dcr.rl.task import SymbolTask

    version = rollout_version(spec, step)
    prompts, requests = _requests(spec, step)
    start = time.monotonic()
    results = engine.rollouts(requests, version, waiting=say, accepted=accepted)
    task = SymbolTask.of(spec.config)
    responses = [[int(t) for t in r["token_ids"]] for r in results]
    group = spec.config.group_size
    return {
        "step": step,
        "version": version,
        "prompts": prompts,
        "responses": responses,
        "logprobs": [[float(x) for x in r["logprobs"]] for r in results],
        "rewards": [task.reward(prompts[i // group], resp) for i, resp in enumerate(responses)],
        "tokens_sha256": tokens_digest(responses),
        "seconds": time.monotonic() - start,
    }


def _broadcast(batch: dict[str, Any] | None, spec: RunSpec) -> Any:
    """Every rank's :class:`~dcr.rl.grpo.Rollouts` of rank 0's ``batch`` (tensors over the
    trainer's gloo group: token ids, log probabilities and rewards, no pickled objects)."""
    import torch
    import torch.distributed as dist

    from dcr.rl.grpo import Rollouts

    cfg = spec.config
    rows, prompt_len, t = cfg.batch_size, cfg.prompt_len, cfg.response_len
    tokens = torch.zeros(rows, prompt_len + t, dtype=torch.int64)
    logprobs = torch.zeros(rows, t, dtype=torch.float32)
    rewards = torch.zeros(rows, dtype=torch.float32)
    if batch is not None:
        built = Rollouts.build(
            batch["prompts"], batch["responses"], batch["logprobs"], batch["rewards"],
            group_size=cfg.group_size,
        )  # fmt: skip
        tokens.copy_(built.tokens)
        logprobs.copy_(built.behaviour_logprobs)
        rewards.copy_(built.rewards)
    for t_ in (tokens, logprobs, rewards):
        dist.broadcast(t_, src=0)
    return Rollouts(
        tokens=tokens, prompt_len=prompt_len, behaviour_logprobs=logprobs, rewards=rewards,
        group_size=cfg.group_size,
    )  # fmt: skip


async def restore(spec: RunSpec, policy: Any, committed: int, log: EventLog | None) -> None:
    """Bring ``policy`` to version ``committed``: load the trainer's last saved state (saved
    after each commit), then replay the steps between it and ``committed`` -- at most one, a
    rank that died after the commit and before its save -- from the stored batches.
    Training is bit-deterministic, so the replayed state is the one that was committed."""
    from dcr.rl.trainer import LATEST

    directory = Path(spec.state_dir)
    batches = Batches(directory / "rollouts")
    saved = 0
    if (directory / LATEST).exists():
        saved = await anyio.to_thread.run_sync(policy.load, directory)
    elif committed > 0 and not directory.exists():
        raise ConfigError(
            f"the fleet committed version {committed} but the trainer has no saved state in "
            f"{directory}: it cannot resume"
        )
    if saved > committed:
        raise ConfigError(
            f"the trainer's saved state is version {saved}, ahead of the committed {committed}"
        )
    for step in range(saved + 1, committed + 1):
        batch = batches.get(step) if policy.rank == 0 else None
        if policy.rank == 0 and batch is None:
            raise ConfigError(f"no stored rollouts of step {step} to replay it from")
        rollouts = await anyio.to_thread.run_sync(_broadcast, batch, spec)
        await anyio.to_thread.run_sync(policy.step, rollouts)
        await anyio.to_thread.run_sync(policy.save, directory, step)
        if log is not None:
            log.emit("rl-replayed", step=step)
    if log is not None and committed:
        log.emit("rl-resumed", version=committed, saved=saved)


class _Refit:
    """How a new version reaches the engine."""

    async def publish(self, version: int) -> dict[str, Any]:
        raise NotImplementedError

    async def finished(self) -> None:
        await anyio.sleep_forever()


async def run_rank(
    spec: RunSpec,
    *,
    rank: int,
    committed: int,
    policy: Any,
    refit: _Refit,
    log: EventLog | None,
) -> None:
    """Train from the committed version to ``spec.steps``, refitting after every step.

    ``policy`` is this rank's :class:`~dcr.rl.trainer.FsdpPolicy`, at version ``committed``
    (see :func:`restore`).  ``log`` is rank 0's event log (``None`` on the others)."""
    engine = EngineClient(Path(spec.engine_ready))
    batches = Batches(Path(spec.state_dir) / "rollouts")

    def say(text: str) -> None:
        if log is not None:
            log.emit("rl-waiting", message=text)

    async with anyio.create_task_group() as tg:
        ahead: _Ahead | None = None  # async: the next step's batch, in flight
        for step in range(committed + 1, spec.steps + 1):
            batch = None
            if rank == 0:
                batch = batches.get(step)
                if batch is None and ahead is not None and ahead.step == step:
                    batch = await ahead.result()
                if batch is None:
                    batch = await anyio.to_thread.run_sync(_fetch, spec, engine, step, say)
                batches.put(batch)
            ahead = None
            rollouts = await anyio.to_thread.run_sync(_broadcast, batch, spec)
            start = time.monotonic()
            metrics = await anyio.to_thread.run_sync(policy.step, rollouts)
            train_s = time.monotonic() - start
            if log is not None and batch is not None:
                staleness = (step - 1) - int(batch["version"])
                if staleness > spec.max_staleness:
                    raise ConfigError(f"step {step} trained on rollouts {staleness} versions old")
                log.emit(
                    "rl-step", step=step, version=step, rollout_version=int(batch["version"]),
                    staleness=staleness, reward=metrics.reward, kl=metrics.kl,
                    loss=metrics.loss, tokens_sha256=batch["tokens_sha256"],
                    rollout_s=batch.get("seconds"), train_s=train_s, metrics=metrics.as_dict(),
                )  # fmt: skip
            if (
                rank == 0
                and spec.mode == "async"
                and step < spec.steps
                and (batches.get(step + 1) is None)
            ):
                ahead = _Ahead(spec, engine, batches, step + 1, say)
                tg.start_soon(ahead.run)
                # The engine holds the batch before the refit starts: it runs on the weights
                # the engine serves now, whatever the refit costs.
                await ahead.wait_accepted()
            report = await refit.publish(step)
            # The trainer's own checkpoint of the version now committed (what a restart
            # resumes from; one that dies before it replays this step, see restore()).
            await anyio.to_thread.run_sync(policy.save, Path(spec.state_dir), step)
            if log is not None:
                log.emit("rl-refit", step=step, version=step, **report)
        if log is not None:
            log.emit("rl-done", version=spec.steps)
        await refit.finished()


class _Ahead:
    """Asynchronous mode: step ``step``'s batch fetched while the previous version is
    refitted (rank 0)."""

    def __init__(
        self,
        spec: RunSpec,
        engine: EngineClient,
        batches: Batches,
        step: int,
        say: Callable[[str], None],
    ) -> None:
        self.spec, self.engine, self.batches, self.step, self.say = spec, engine, batches, step, say
        self._accepted = anyio.Event()
        self._done = anyio.Event()
        self._batch: dict[str, Any] | None = None
        self._error: BaseException | None = None

    async def run(self) -> None:
        def accepted() -> None:
            anyio.from_thread.run_sync(self._accepted.set)

        try:
            self._batch = await anyio.to_thread.run_sync(
                lambda: _fetch(self.spec, self.engine, self.step, self.say, accepted=accepted)
            )
            # Stored at once: a trainer restarted before the step gets the same batch.
            await anyio.to_thread.run_sync(self.batches.put, self._batch)
        except Exception as exc:  # handed to the step that needs the batch
            self._error = exc
        finally:
            self._accepted.set()
            self._done.set()

    async def wait_accepted(self) -> None:
        with anyio.fail_after(self.engine.wait_s):
            await self._accepted.wait()

    async def result(self) -> dict[str, Any]:
        await self._done.wait()
        if self._error is not None:
            raise self._error
        assert self._batch is not None
        return self._batch
