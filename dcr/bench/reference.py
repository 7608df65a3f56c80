"""The transport-only full-checkpoint reference (paper §8.1 "Reference", Fig. C.5).

Each owner of a fleet moves its share of the checkpoint's bytes through the fleet's own
transport, behind the same emulated link, and each rollout node receives all of it; nothing
is saved, loaded, encoded or applied (the reference excludes checkpoint save and load, to its
advantage).  Every role is a process of its own, as in the fleet:

* relay tree: the fleet's relay nodes run (``dcr relay``); one stand-in receiver per rollout
  node subscribes at its node; the owners then stream their shares to the root at once.  The
  reference is the time from the start until the last node received every byte.
* object storage: the owners upload their shares at once; then every rollout node downloads
  all of it (the paper's order: "each training node uploads an eighth of the checkpoint ...
  and each rollout node then downloads all of it").  The reference is the upload time plus
  the download time.

:func:`run_reference` drives the processes; ``python -m dcr.bench.reference send|fetch``
is one of them: it reports ``READY``, waits for ``GO`` on stdin, does its transfers and
prints one JSON line ``{"start", "end", "bytes", "payloads"}``.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import anyio

from dcr.adapters.security import COORDINATOR, Identity
from dcr.errors import ConfigError, TransportError
from dcr.fleet.config import FleetConfig, free_port, load_fleet
from dcr.fleet.runtime import LAUNCHED
from dcr.protocol.types import PayloadKey

__all__ = ["ReferenceResult", "main", "run_reference", "split"]

REFERENCE_ATTEMPT = 10**18
"""Lowest attempt id of the reference's payloads (far above any attempt of the fleet run).
Each transfer takes an id of its own above it: object storage refuses payloads of an attempt
that was cleaned up, as each transfer's is at its end."""
DRAIN_S = 60.0
"""Relay tree: how long the nodes may still take once every owner's sends returned."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ReferenceResult:
    """One reference transfer: its seconds and, on object storage, its two phases."""

    seconds: float
    upload_s: float | None = None
    download_s: float | None = None
    bytes_per_node: int = 0


def split(total: int, parts: int, piece: int) -> list[list[int]]:
    """``total`` bytes in ``parts`` shares as equal as possible, each cut into payloads of at
    most ``piece`` bytes."""
    if parts < 1 or piece < 1 or total < 0:
        raise ConfigError(f"cannot split {total} bytes into {parts} shares of {piece}-byte pieces")
    shares = [total // parts + (1 if i < total % parts else 0) for i in range(parts)]
    return [[min(piece, s - off) for off in range(0, s, piece)] for s in shares]


# -- one process ----------------------------------------------------------------------------------


def _await_go(deadline_s: float) -> None:
    ready, _, _ = select.select([sys.stdin], [], [], deadline_s)
    if not ready or sys.stdin.readline().strip() != "GO":
        raise SystemExit("no GO from the benchmark")


def reference_name(node: str) -> str:
    """The name rollout node ``node``'s reference download subscribes under (with keys, the
    ``receiver`` identity of that name needs a key pair: :func:`reference_identities`)."""
    return f"reference-{node}"


def reference_identities(cfg: FleetConfig) -> list[Identity]:
    """The identities the reference transfer adds to a fleet's: one receiver per node."""
    return [Identity("receiver", reference_name(n.name)) for n in cfg.rollout]


def _reference_attempt() -> int:
    """A fresh attempt id for one transfer (milliseconds since the epoch above the base: a
    later transfer, or a later run over the same storage, never reuses a cleaned one)."""
    return REFERENCE_ATTEMPT + time.time_ns() // 1_000_000


async def _send(
    cfg: FleetConfig, owner: str, sizes: list[int], deadline_s: float, attempt: int
) -> None:
    from dcr.fleet.runtime import make_transport

    transport = make_transport(cfg, identity=Identity("owner", owner))
    try:
        data = os.urandom(max(sizes, default=0))
        limiter = anyio.CapacityLimiter(cfg.trainer.sends_in_flight)
        print("READY", flush=True)
        await anyio.to_thread.run_sync(_await_go, deadline_s)
        start = time.time()

        async def one(pid: int, size: int) -> None:
            async with limiter:
                body = data if size == len(data) else data[:size]
                await transport.send(PayloadKey(attempt=attempt, owner=owner,
                                                payload_id=pid), body)  # fmt: skip

        with anyio.fail_after(deadline_s):
            async with anyio.create_task_group() as tg:
                for pid, size in enumerate(sizes):
                    tg.start_soon(one, pid, size)
        end = time.time()
        print(json.dumps({"start": start, "end": end, "bytes": sum(sizes),
                          "payloads": len(sizes)}), flush=True)  # fmt: skip
    finally:
        with anyio.CancelScope(shield=True):
            await transport.aclose()


async def _fetch(
    cfg: FleetConfig, node: str, payloads: int, deadline_s: float, attempt: int
) -> None:
    from dcr.fleet.runtime import make_transport

    name = reference_name(node)
    transport = make_transport(cfg, node=node, identity=Identity("receiver", name))
    try:
        print("READY", flush=True)
        await anyio.to_thread.run_sync(_await_go, deadline_s)
        start = time.time()
        got = count = 0
        with anyio.fail_after(deadline_s):
            async for d in transport.subscribe(name):
                await transport.taken(name, d.key)
                if d.key.attempt == attempt:
                    got += len(d.data)
                    count += 1
                    if count == payloads:
                        break
        end = time.time()
        print(json.dumps({"start": start, "end": end, "bytes": got, "payloads": count}),
              flush=True)  # fmt: skip
    finally:
        with anyio.CancelScope(shield=True):
            await transport.aclose()


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m dcr.bench.reference send|fetch --fleet F ...``: one process of the
    reference transfer."""
    from dcr.fleet.runtime import die_with_parent

    p = argparse.ArgumentParser(prog="python -m dcr.bench.reference")
    p.add_argument("role", choices=["send", "fetch"])
    p.add_argument("--fleet", required=True)
    p.add_argument("--owner", help="send: the owner whose share this process sends")
    p.add_argument("--sizes", help="send: comma-separated payload sizes")
    p.add_argument("--node", help="fetch: the rollout node this process receives for")
    p.add_argument("--payloads", type=int, default=0, help="fetch: payloads to wait for")
    p.add_argument("--deadline-s", type=float, default=1800.0)
    p.add_argument("--attempt", type=int, default=REFERENCE_ATTEMPT, help="the transfer's id")
    args = p.parse_args(argv)
    die_with_parent()
    cfg = load_fleet(args.fleet)
    if args.role == "send":
        sizes = [int(s) for s in args.sizes.split(",") if s]
        anyio.run(_send, cfg, args.owner, sizes, args.deadline_s, args.attempt,
                  backend="asyncio")  # fmt: skip
    else:
        anyio.run(_fetch, cfg, args.node, args.payloads, args.deadline_s, args.attempt,
                  backend="asyncio")  # fmt: skip


# -- the driver -----------------------------------------------------------------------------------


class _Proc:
    """A helper process that reports READY and one JSON result line on stdout."""

    def __init__(self, argv: list[str], log: Path) -> None:
        with log.open("ab") as err:
            self.popen = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
                     LAUNCHED: "1"},
            )  # fmt: skip
        self.log = log

    def line(self, timeout_s: float) -> str:
        out: IO[bytes] | None = self.popen.stdout
        assert out is not None
        ready, _, _ = select.select([out], [], [], timeout_s)
        text = out.readline().decode().strip() if ready else ""
        if not text:
            raise TransportError(
                f"reference process {self.popen.args!r} gave no answer within {timeout_s:.0f} s "
                f"(exit {self.popen.poll()}); see {self.log}",
                retryable=False,
                check="reference",
            )
        return text

    def go(self) -> None:
        stdin = self.popen.stdin
        assert stdin is not None
        stdin.write(b"GO\n")
        stdin.flush()

    def result(self, timeout_s: float) -> dict[str, Any]:
        found: dict[str, Any] = json.loads(self.line(timeout_s))
        return found

    def stop(self) -> None:
        p = self.popen
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for stream in (p.stdin, p.stdout):
            if stream is not None:
                stream.close()


def _start(argv: list[str], log: Path, timeout_s: float) -> _Proc:
    proc = _Proc(argv, log)
    if proc.line(timeout_s) != "READY":
        raise TransportError(f"reference process {argv!r} did not start; see {log}",
                             retryable=False, check="reference")  # fmt: skip
    return proc


def _go(procs: Sequence[_Proc]) -> float:
    t = time.time()
    for p in procs:
        p.go()
    return t


def _results(procs: Sequence[_Proc], deadline_s: float) -> list[dict[str, Any]]:
    """Every process's result line, in order; fails at once when one of them exits without
    one (a failed transfer leaves the others waiting for bytes that never come)."""
    out: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + deadline_s
    while len(out) < len(procs):
        for i, p in enumerate(procs):
            if i in out:
                continue
            stream = p.popen.stdout
            assert stream is not None
            ready, _, _ = select.select([stream], [], [], 0.05)
            if ready:
                out[i] = p.result(1.0)
            elif p.popen.poll() is not None:
                raise TransportError(f"reference process {p.popen.args!r} exited with "
                                     f"{p.popen.returncode}; see {p.log}", retryable=True,
                                     check="reference")  # fmt: skip
        if time.monotonic() > deadline:
            raise TransportError(f"the reference did not finish within {deadline_s:.0f} s",
                                 retryable=True, check="reference")  # fmt: skip
    return [out[i] for i in range(len(procs))]


def run_reference(
    cfg: FleetConfig,
    *,
    checkpoint_bytes: int,
    object_bytes: int = 64 << 20,
    deadline_s: float = 600.0,
    tries: int = 3,
    say: Callable[[str], None] = lambda line: None,
) -> ReferenceResult:
    """Move ``checkpoint_bytes`` from the fleet's owners to every rollout node through the
    fleet file's transport (its ``[transport]`` section, link included), in payloads of at
    most ``object_bytes``; returns the reference time (see the module docstring).  A
    transfer that fails (a process's transport gave up) is run again, ``tries`` times in
    all."""
    for i in range(tries):
        try:
            return _transfer(cfg, checkpoint_bytes, object_bytes, deadline_s, say)
        except TransportError as exc:
            if not exc.retryable or i == tries - 1:
                raise
            say(f"reference: {exc}; running it again")
    raise AssertionError("unreachable")


def _transfer(
    cfg: FleetConfig,
    checkpoint_bytes: int,
    object_bytes: int,
    deadline_s: float,
    say: Callable[[str], None],
) -> ReferenceResult:
    from dcr.fleet.runtime import make_transport

    logs = cfg.run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    shares = split(checkpoint_bytes, len(cfg.owners), object_bytes)
    attempt = _reference_attempt()
    me = [sys.executable, "-m", "dcr.bench.reference"]
    fleet = ["--fleet", str(cfg.path), "--deadline-s", str(deadline_s), "--attempt", str(attempt)]
    relay = cfg.transport.get("kind") == "relay"
    procs: list[_Proc] = []

    def senders() -> list[_Proc]:
        out = []
        for owner, sizes in zip(cfg.owners, shares, strict=True):
            argv = [*me, "send", *fleet, "--owner", owner, "--sizes", ",".join(map(str, sizes))]
            out.append(_start(argv, logs / f"reference-{owner}.log", 120))
        procs.extend(out)
        return out

    def fetchers() -> list[_Proc]:
        count = sum(len(s) for s in shares)
        out = []
        for node in cfg.rollout:
            argv = [*me, "fetch", *fleet, "--node", node.name, "--payloads", str(count)]
            out.append(_start(argv, logs / f"reference-{node.name}.log", 120))
        procs.extend(out)
        return out

    try:
        if relay:
            ports = {n.name: n.port or free_port(cfg.host) for n in cfg.rollout}
            cfg.ports_file.write_text(json.dumps(ports))
            for node in cfg.rollout:
                argv = [sys.executable, "-m", "dcr.cli", "relay", "--fleet", str(cfg.path),
                        "--node", node.name]  # fmt: skip
                procs.append(_Proc(argv, logs / f"reference-relay-{node.name}.log"))
            rx = fetchers()
            _go(rx)
            _await_subscribed(cfg, [reference_name(n.name) for n in cfg.rollout])
            tx = senders()
            say(f"reference: {len(tx)} owners stream {checkpoint_bytes / 1e9:.2f} GB to "
                f"{len(rx)} nodes over the relay tree")  # fmt: skip
            t0 = _go(tx)
            _results(tx, deadline_s)
            # Every send returned once every subscribed stand-in took it; a stand-in that
            # still misses payloads lost its link meanwhile (a stalled process): run again.
            results = _results(rx, DRAIN_S)
            return ReferenceResult(
                seconds=max(r["end"] for r in results) - t0,
                bytes_per_node=min(r["bytes"] for r in results),
            )
        tx = senders()
        say(f"reference: {len(tx)} owners upload {checkpoint_bytes / 1e9:.2f} GB")
        t0 = _go(tx)
        upload = max(r["end"] for r in _results(tx, deadline_s)) - t0
        rx = fetchers()
        say(f"reference: {len(rx)} nodes download all of it")
        t1 = _go(rx)
        results = _results(rx, deadline_s)
        download = max(r["end"] for r in results) - t1
        return ReferenceResult(
            seconds=upload + download,
            upload_s=upload,
            download_s=download,
            bytes_per_node=min(r["bytes"] for r in results),
        )
    finally:
        for p in procs:
            p.stop()
        if not relay:

            async def clean() -> None:
                transport = make_transport(cfg, identity=COORDINATOR)
                try:
                    await transport.cleanup(attempt)
                finally:
                    await transport.aclose()

            anyio.run(clean, backend="asyncio")


def _await_subscribed(cfg: FleetConfig, names: list[str], timeout_s: float = 60.0) -> None:
    """Wait until the relay root knows every stand-in receiver (bounded)."""
    from dcr.adapters.transport.relay import RelayTransport
    from dcr.fleet.runtime import make_transport

    async def poll() -> None:
        probe = make_transport(cfg, identity=COORDINATOR)
        assert isinstance(probe, RelayTransport)
        try:
            with anyio.fail_after(timeout_s):
                while True:
                    try:
                        if set(names) <= (await probe.tree_status()).receivers:
                            return
                    except TransportError:
                        pass  # the root is still starting
                    await anyio.sleep(0.1)
        finally:
            await probe.aclose()

    anyio.run(poll, backend="asyncio")


if __name__ == "__main__":
    main(sys.argv[1:])
