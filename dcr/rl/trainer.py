"""One rank of an FSDP2 GRPO trainer on the CPU, bit-deterministic given the same rollouts.

:class:`FsdpPolicy` holds the policy as fp32 master weights sharded by ``fully_shard`` over a
1-D mesh of every rank (each decoder layer is one FSDP unit, the root holds the embeddings,
the final norm and the head), run under ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)``: every forward and backward computes in bf16 on the bf16 casts of the
masters, gradients are reduce-scattered in fp32, AdamW updates the fp32 shards.  A frozen
bf16 copy of the initial weights (whole on every rank) is the KL reference.

What the rollout engines serve is exactly what the next forward uses: the bf16 casts of the
masters.  :meth:`FsdpPolicy.source` hands those shards to dcr (``FsdpSource(model,
dtype=bf16)``, each rank casting its own shard); :meth:`FsdpPolicy.export_checkpoint` writes the
same values gathered as a full Hugging Face checkpoint (the dense-refit reference).

Determinism, for two runs fed the same rollouts to produce the same bits:

- one intra-op thread per rank and ``torch.use_deterministic_algorithms(True)``
  (:func:`deterministic_setup`): CPU kernels then reduce in one fixed order;
- no dropout (``attention_dropout=0``, eval mode), no random number generator anywhere in a step;
- the batch is split by rank into fixed contiguous row ranges; advantages and the mean reward
  are computed from the whole batch on every rank;
- each rank's loss is its tokens' sum divided by the *global* token count and FSDP's gradient
  reduction is a plain sum (divide factor 1, sum reductions only), so the reduced gradient is
  the gradient of the global token mean;
- scalar reductions (metrics, the gradient norm) gather every rank's partial value and add
  them in rank order on every rank, in float64, instead of relying on a collective's order.

:meth:`FsdpPolicy.save` / :meth:`FsdpPolicy.load` keep the trainer's resumable state: each
rank's fp32 shards and AdamW moments and step counts, in safetensors files written atomically,
and a pointer file naming the last complete version.  A trainer resumed from it continues bit
for bit as one that never stopped.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from dcr.errors import CheckpointError, ConfigError
from dcr.rl.config import RLConfig
from dcr.rl.files import atomic_write, fsync_dir, read_safetensors, write_safetensors
from dcr.rl.grpo import Rollouts, group_advantages, grpo_token_terms, token_logprobs
from dcr.rl.policy import hf_config, load_model, read_config_text, read_weights, write_checkpoint

if TYPE_CHECKING:
    from dcr.adapters.sources.fsdp import FsdpSource

__all__ = ["STATE_FORMAT", "FsdpPolicy", "StepMetrics", "deterministic_setup"]

STATE_FORMAT = "dcr-rl-trainer-state-1"
"""Recorded in every saved state file; :meth:`FsdpPolicy.load` refuses any other."""
LATEST = "LATEST"
"""The file of a state directory that names its last complete version."""
_VERSION_DIR = re.compile(r"v[0-9]{8,}")
_STATE_FILE = re.compile(r"\.?rank[0-9]{5}-of-[0-9]{5}\.safetensors(\.[^/]+\.tmp)?")
"""A rank's state file in a version folder, or the temporary file of an unfinished write."""


def _remove_version(folder: Path) -> None:
    """Remove an older version's folder of saved state: its state files (and temporary files
    of unfinished writes), then the folder once nothing else is in it -- a file that is not
    the trainer's stays, and so does its folder."""
    with contextlib.suppress(OSError):
        for entry in folder.iterdir():
            if _STATE_FILE.fullmatch(entry.name) and (entry.is_symlink() or not entry.is_dir()):
                entry.unlink(missing_ok=True)
        folder.rmdir()


def deterministic_setup() -> None:
    """Make this process's CPU kernels bit-reproducible: one intra-op thread and
    ``torch.use_deterministic_algorithms(True)`` (which raises on an op that has no
    deterministic implementation instead of silently varying)."""
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)


@dataclass(frozen=True, kw_only=True)
class StepMetrics:
    """What one optimizer step reports, identical on every rank.

    ``reward``: mean reward of the batch; ``kl``: mean k3 KL to the reference per response
    token; ``loss``: the objective (mean over response tokens of ``pg + beta * kl``);
    ``pg_loss``: its policy-gradient part; ``clip_fraction``: share of tokens whose PPO clip
    was active; ``grad_norm``: the global gradient norm before clipping; ``step``: optimizer
    steps taken, this one included.
    """

    step: int
    reward: float
    kl: float
    loss: float
    pg_loss: float
    clip_fraction: float
    grad_norm: float

    def as_dict(self) -> dict[str, float | int]:
        """The fields by name (JSON-ready)."""
        return {
            "step": self.step,
            "reward": self.reward,
            "kl": self.kl,
            "loss": self.loss,
            "pg_loss": self.pg_loss,
            "clip_fraction": self.clip_fraction,
            "grad_norm": self.grad_norm,
        }


def _gather(values: list[float]) -> list[list[float]]:
    """Every rank's ``values`` (float64), in rank order, on every rank."""
    mine = torch.tensor(values, dtype=torch.float64)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, mine)
    return [[float(x) for x in p.tolist()] for p in parts]


def _rank_sum(values: list[float]) -> list[float]:
    """Every rank's ``values`` added element-wise in rank order (float64), on every rank."""
    parts = [torch.tensor(p, dtype=torch.float64) for p in _gather(values)]
    total = parts[0].clone()
    for p in parts[1:]:
        total += p
    return [float(x) for x in total.tolist()]


_DIMENSIONS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
)


def _check_dimensions(checkpoint: dict[str, Any], config: RLConfig) -> None:
    """The checkpoint's model must be the one ``config`` describes."""
    expected = hf_config(config).to_dict()
    differ = [k for k in _DIMENSIONS if checkpoint.get(k) != expected.get(k)]
    if differ:
        raise ConfigError(
            "the checkpoint's model is not the config's: "
            + ", ".join(f"{k} {checkpoint.get(k)} != {expected.get(k)}" for k in differ),
            check="config",
        )


class FsdpPolicy:
    """This rank's part of the policy, its optimizer and the frozen reference.

    Collective at construction and in :meth:`step`, :meth:`source`, :meth:`export_checkpoint`,
    :meth:`save` and :meth:`load`: every rank of the default (gloo) process group calls them
    in the same order.  ``checkpoint`` is version 0's Hugging Face directory
    (:func:`dcr.rl.policy.write_initial_checkpoint`), readable by every rank.
    """

    def __init__(self, checkpoint: str | os.PathLike[str], config: RLConfig) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError("FsdpPolicy needs an initialised torch.distributed process group")
        deterministic_setup()
        self.config = config
        self.checkpoint = Path(checkpoint)
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.steps = 0
        self._config_text = read_config_text(self.checkpoint)
        initial = read_weights(self.checkpoint)
        self._catalog = {n: (tuple(t.shape), t.dtype) for n, t in initial.items()}
        _check_dimensions(json.loads(self._config_text), config)

        self.reference = load_model(self.checkpoint, dtype=torch.bfloat16, state_dict=initial)
        self.reference.requires_grad_(False)
        model = load_model(self.checkpoint, dtype=torch.float32, state_dict=initial)
        mesh = init_device_mesh("cpu", (self.world,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        layers: Any = model.get_submodule("model.layers")
        for layer in layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                # Plain sums: each rank's loss is already divided by the global token count.
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)
        self.model = model
        self._names = [n for n, _ in model.named_parameters()]
        if set(self._names) != set(self._catalog):
            raise ConfigError("the model's parameters are not the checkpoint's tensors")
        self.optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=config.lr,
            betas=(config.adam_beta1, config.adam_beta2),
            eps=config.adam_eps,
            weight_decay=config.weight_decay,
            foreach=False,
        )

    # -- training --------------------------------------------------------------------------

    def rows(self, batch_size: int) -> range:
        """The rows of a ``batch_size`` batch this rank trains on (contiguous, fixed by rank:
        the first ``batch_size % world`` ranks take one row more)."""
        base, extra = divmod(batch_size, self.world)
        start = self.rank * base + min(self.rank, extra)
        return range(start, start + base + (1 if self.rank < extra else 0))

    def step(self, batch: Rollouts) -> StepMetrics:
        """One GRPO update on ``batch`` (the whole batch, identical on every rank): this rank's
        rows forward and backward, gradients reduced, gradient clipping, one AdamW step.
        Returns the metrics of the batch under the weights *before* the update."""
        cfg = self.config
        if batch.group_size != cfg.group_size:
            raise ConfigError(f"batch groups of {batch.group_size}, config {cfg.group_size}")
        if batch.size < self.world:
            raise ConfigError(f"a batch of {batch.size} rows cannot feed {self.world} ranks")
        advantages = group_advantages(batch.rewards, batch.group_size, eps=cfg.adv_eps)
        rows = self.rows(batch.size)
        tokens = batch.tokens[rows.start : rows.stop]
        p = batch.prompt_len
        responses = tokens[:, p:]
        global_tokens = batch.size * batch.response_len

        self.model.train(False)  # no dropout; gradients flow regardless
        with torch.no_grad():
            ref_logits = self.reference(input_ids=tokens, use_cache=False).logits
            ref_logprobs = token_logprobs(ref_logits[:, p - 1 : -1], responses)
        logits = self.model(input_ids=tokens, use_cache=False).logits
        logprobs = token_logprobs(logits[:, p - 1 : -1], responses)
        terms = grpo_token_terms(
            logprobs,
            batch.behaviour_logprobs[rows.start : rows.stop],
            ref_logprobs,
            advantages[rows.start : rows.stop],
            clip_eps=cfg.clip_eps,
            beta=cfg.beta,
        )
        loss = terms.loss.sum() / global_tokens
        loss.backward()  # type: ignore[no-untyped-call]
        grad_norm = self._clip_gradients()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1

        sums = _rank_sum(
            [
                float(terms.loss.detach().double().sum()),
                float(terms.pg.detach().double().sum()),
                float(terms.kl.detach().double().sum()),
                float(terms.clipped.double().sum()),
            ]
        )
        return StepMetrics(
            step=self.steps,
            reward=float(batch.rewards.double().mean()),
            loss=sums[0] / global_tokens,
            pg_loss=sums[1] / global_tokens,
            kl=sums[2] / global_tokens,
            clip_fraction=sums[3] / global_tokens,
            grad_norm=grad_norm,
        )

    def _clip_gradients(self) -> float:
        """The global gradient norm (before clipping); scales every local gradient shard by
        ``max_grad_norm / norm`` when the norm exceeds it.  The squared norms of the disjoint
        shards are added in rank order, so every rank computes the same coefficient."""
        grads = [self._local(p.grad) for p in self.model.parameters() if p.grad is not None]
        local = sum((float(g.double().pow(2).sum()) for g in grads), 0.0)
        norm = math.sqrt(_rank_sum([local])[0])
        limit = self.config.max_grad_norm
        if limit > 0 and norm > limit:
            coef = limit / (norm + 1e-6)
            with torch.no_grad():
                for g in grads:
                    g.mul_(coef)
        return norm

    @staticmethod
    def _local(t: torch.Tensor) -> torch.Tensor:
        """A DTensor's local tensor (the storage the optimizer updates); a tensor as is."""
        from torch.distributed.tensor import DTensor

        return t.to_local() if isinstance(t, DTensor) else t

    # -- serving ---------------------------------------------------------------------------

    def source(self) -> FsdpSource:
        """dcr's view of this rank's shards: the bf16 casts of its fp32 masters, named by
        checkpoint names (checked against the initial checkpoint's tensors).  Collective."""
        from dcr.adapters.sources.fsdp import FsdpSource

        source = FsdpSource(self.model, dtype=torch.bfloat16)
        served = {name: (tuple(s.shape), s.dtype) for name, s in source.catalog.items()}
        expected = {name: (shape, torch.bfloat16) for name, (shape, _) in self._catalog.items()}
        if served != expected:
            differ = sorted(set(served) ^ set(expected)) or sorted(
                n for n in served if served[n] != expected[n]
            )
            raise ConfigError(
                f"the served catalog differs from the checkpoint's tensors: {differ[:3]}",
                check="catalog",
            )
        return source

    def served_state_dict(self) -> dict[str, torch.Tensor]:
        """Every served tensor, gathered whole on every rank: the bf16 casts of the fp32
        masters, by checkpoint name.  Collective (one all-gather per parameter)."""
        from torch.distributed.tensor import DTensor

        out = {}
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                full = p.full_tensor() if isinstance(p, DTensor) else p.detach()
                out[name] = full.to(torch.bfloat16)
        return out

    def export_checkpoint(self, directory: str | os.PathLike[str]) -> Path:
        """Write the served weights as a full Hugging Face checkpoint (``config.json`` of the
        initial checkpoint and ``model.safetensors`` in bf16) into ``directory``: rank 0
        writes, every rank gathers and waits until the files are durable.  Collective."""
        served = self.served_state_dict()
        out = Path(directory)
        if self.rank == 0:
            write_checkpoint(out, self._config_text, served)
        dist.barrier()
        return out

    # -- resumable state -------------------------------------------------------------------

    def _state_file(self, directory: Path, version: int) -> Path:
        return (
            directory / f"v{version:08d}" / f"rank{self.rank:05d}-of-{self.world:05d}.safetensors"
        )

    def save(self, directory: str | os.PathLike[str], version: int) -> Path:
        """Save this trainer's state as ``version`` under ``directory``.  Collective.

        Every rank writes ``v<version>/rank<r>-of-<world>.safetensors`` atomically: its fp32
        parameter shards and AdamW state (``exp_avg``, ``exp_avg_sq``, ``step`` of every
        parameter) and, as metadata, the version, the steps taken and the config.  Once every
        rank's file is durable, rank 0 replaces the pointer file ``LATEST`` with the version
        (atomically) and removes older versions, so a crash at any moment leaves one
        complete version named by ``LATEST``.  ``directory`` must be one folder every rank
        sees (a shared file system when the ranks span machines).  A rank that fails to
        write makes every rank raise, and ``LATEST`` is left as it was.  Returns the
        version's folder.
        """
        if version < 0:
            raise ConfigError(f"version must not be negative, got {version}")
        root = Path(directory)
        path = self._state_file(root, version)
        tensors: dict[str, torch.Tensor] = {}
        for name, p in self.model.named_parameters():
            tensors[f"param/{name}"] = self._local(p.detach())
            state = self.optimizer.state.get(p, {})
            for key in ("exp_avg", "exp_avg_sq", "step"):
                if key in state:
                    tensors[f"{key}/{name}"] = self._local(state[key].detach())
        metadata = {
            "format": STATE_FORMAT,
            "version": str(version),
            "steps": str(self.steps),
            "rank": str(self.rank),
            "world": str(self.world),
            "config": self.config.to_json(),
        }
        error: Exception | None = None
        try:
            write_safetensors(path, tensors, metadata)
        except (OSError, ConfigError) as exc:
            error = exc
        _agree(error, f"saving version {version}")
        if self.rank == 0:
            atomic_write(root / LATEST, json.dumps({"version": version}).encode())
            for old in root.iterdir():
                if old.is_dir() and _VERSION_DIR.fullmatch(old.name) and old != path.parent:
                    _remove_version(old)
            fsync_dir(root)
        dist.barrier()
        return path.parent

    def load(self, directory: str | os.PathLike[str]) -> int:
        """Restore the state :meth:`save` left under ``directory`` (the version ``LATEST``
        names) into this trainer, which must have been built with the same config and world
        size; returns that version.  Collective: every rank reads and checks its file first,
        and if any rank cannot, every rank raises :class:`~dcr.errors.CheckpointError` with
        nothing restored."""
        error: Exception | None = None
        try:
            version, steps, tensors = self._read_state(Path(directory))
        except (OSError, ConfigError) as exc:
            error = exc
        _agree(error, f"loading the trainer state from {os.fspath(directory)}")
        if len({v[0] for v in _gather([float(version)])}) != 1:
            raise CheckpointError(f"the ranks read different {LATEST} versions", check="version")
        self.optimizer.state.clear()
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                self._local(p).copy_(tensors[f"param/{name}"])
                if f"step/{name}" not in tensors:
                    continue
                state: dict[str, Any] = {"step": tensors[f"step/{name}"].clone()}
                for key in ("exp_avg", "exp_avg_sq"):
                    moment = torch.zeros_like(p)
                    self._local(moment).copy_(tensors[f"{key}/{name}"])
                    state[key] = moment
                self.optimizer.state[p] = state
        self.steps = steps
        dist.barrier()
        return version

    def _read_state(self, root: Path) -> tuple[int, int, dict[str, torch.Tensor]]:
        """This rank's saved state under ``root``: the version, the steps taken and every
        tensor, each checked against this trainer (names, shapes, dtypes, config)."""
        try:
            version = int(json.loads((root / LATEST).read_text())["version"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"no readable {LATEST} in {root}", check="missing") from exc
        tensors, metadata = read_safetensors(self._state_file(root, version))
        expected = {
            "format": STATE_FORMAT,
            "version": str(version),
            "rank": str(self.rank),
            "world": str(self.world),
        }
        for key, value in expected.items():
            if metadata.get(key) != value:
                raise CheckpointError(
                    f"state file has {key}={metadata.get(key)!r}, expected {value!r}",
                    check="header",
                )
        try:
            saved_config = RLConfig.from_dict(json.loads(metadata["config"]))
            steps = int(metadata["steps"])
        except (KeyError, ValueError, TypeError) as exc:
            raise CheckpointError("malformed state metadata", check="header") from exc
        if saved_config != self.config:
            raise CheckpointError("the state was saved under another config", check="config")
        wanted: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        stepped = {k.partition("/")[2] for k in tensors if k.startswith("step/")}
        for name, p in self.model.named_parameters():
            local = self._local(p)
            shard = (tuple(local.shape), local.dtype)
            wanted[f"param/{name}"] = shard
            if name in stepped:
                wanted[f"exp_avg/{name}"] = shard
                wanted[f"exp_avg_sq/{name}"] = shard
                wanted[f"step/{name}"] = ((), torch.float32)
        found = {k: (tuple(t.shape), t.dtype) for k, t in tensors.items()}
        if found != wanted:
            differ = sorted(k for k in set(found) | set(wanted) if found.get(k) != wanted.get(k))
            raise CheckpointError(
                f"the saved tensors do not match this trainer's shards: {differ[:3]}",
                check="shape",
            )
        return version, steps, tensors


def _agree(error: Exception | None, what: str) -> None:
    """Raise on every rank if ``what`` failed on any: this rank's own error, or a
    :class:`~dcr.errors.CheckpointError` naming the ranks that failed."""
    failed = [r for r, v in enumerate(_gather([1.0 if error else 0.0])) if v[0]]
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(f"{what} failed on rank(s) {failed}", check="rank")
