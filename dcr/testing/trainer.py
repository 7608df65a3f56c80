"""A multi-process trainer harness for tests and examples (CPU, gloo).

:func:`spawn` runs a function in ``world`` fresh processes joined in a gloo process group on
127.0.0.1 and collects what each returns as JSON; :func:`build_payloads` turns one rank's
training group into payload bytes for one attempt; :func:`apply_payloads` decodes payloads
strictly and applies them, in declared order, to receivers.  Between them the payload bytes
are all that crosses from the trainer to the rollout side, as over a transport.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dcr.apply.applier import Applier
from dcr.delta.build import BuildStats
from dcr.delta.group import TrainingGroup
from dcr.errors import DcrError
from dcr.fleet.config import free_port
from dcr.tensors.records import Mode, TensorSpec
from dcr.wire.decode import decode_payload
from dcr.wire.encode import encode_bucket
from dcr.wire.seal import payload_key

__all__ = ["apply_payloads", "build_payloads", "spawn"]


def _run(
    rank: int,
    world: int,
    port: int,
    out: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    timeout_s: float,
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        GLOO_SOCKET_IFNAME="lo",
    )
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
    )
    try:
        result = fn(rank, world, *args)
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()  # no rank tears the group down while a peer's last collective runs
    finally:
        dist.destroy_process_group()
    # The rank's work is done and its result written: leave without interpreter finalization,
    # during which torch's gloo threads of a loaded machine have been seen to abort the process
    # (std::terminate) after a successful run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = 300.0) -> list[Any]:
    """Run ``fn(rank, world, *args)`` in ``world`` processes of one gloo group; their results.

    ``fn`` must be importable by name (a module-level function) and return JSON-ready values.
    A rank that raises makes this raise (``torch.multiprocessing.ProcessRaisedException``)
    once every rank has ended; ``timeout_s`` bounds every collective, so a rank waiting on a
    dead peer ends too.
    """
    from torch.multiprocessing.spawn import spawn as start

    with tempfile.TemporaryDirectory(prefix="dcr-trainer-") as out:
        start(  # type: ignore[no-untyped-call]
            _run,
            args=(world, free_port(), out, fn, args, timeout_s),
            nprocs=world,
            join=True,
        )
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]


def build_payloads(
    group: TrainingGroup,
    *,
    attempt: int,
    mode: Mode = Mode.MIXED,
    xor_allowed: Container[str] = frozenset(),
    zstd_level: int = 1,
    fleet_secret: bytes | None = None,
) -> tuple[list[bytes], BuildStats]:
    """The payloads of one attempt from the owners ``group`` hosts (its staged candidate),
    sealed with the payload key of ``fleet_secret`` when given."""
    seal_key = payload_key(fleet_secret)
    payloads = []
    total = BuildStats()
    for owner, (buckets, stats) in group.build(mode=mode, xor_allowed=xor_allowed).items():
        for seq, bucket in enumerate(buckets):
            payloads.append(
                encode_bucket(
                    items=bucket.items,
                    attempt=attempt,
                    owner=owner,
                    payload_id=seq,
                    final=bucket.final,
                    level=zstd_level,
                    seal_key=seal_key,
                )
            )
        total.merge(stats)
    return payloads, total


def apply_payloads(
    receivers: Sequence[Applier],
    catalog: Mapping[str, TensorSpec],
    payloads: Iterable[bytes],
    *,
    fleet_secret: bytes | None = None,
) -> None:
    """Decode every payload strictly and apply them in declared order on every receiver
    (with ``fleet_secret``, each must carry a keyed seal under its payload key)."""
    data = list(payloads)
    seal_key = payload_key(fleet_secret)
    for r in receivers:
        decoded = [
            decode_payload(p, catalog=catalog, xor_allowed=r.xor_allowed(), seal_key=seal_key)
            for p in data
        ]
        decoded.sort(key=lambda p: p.header.order)
        attempts = {p.header.attempt for p in decoded}
        if len(attempts) > 1:
            raise DcrError(f"payloads of several attempts: {sorted(attempts)}", check="attempt")
        if decoded:
            r.apply_payloads((p.items for p in decoded), attempt=decoded[0].header.attempt)
