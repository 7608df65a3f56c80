"""The trainer's side of the rollout engine: HTTP to ``python -m dcr.integrations.vllm``.

The engine process writes ``{"url", "pid"}`` to its ready file once it serves; a restarted
engine writes a new one.  On Ray the engine actor registers its URL in the fleet's directory
actor instead, and the client is given ``ray:NAMESPACE/FLEET/ENGINE`` (:data:`RAY_ENGINE`)
where it would be given a ready file.  :class:`EngineClient` looks the URL up again on every
connection failure, so a trainer waits through an engine restart (bounded by ``wait_s``)
instead of failing.  Every
call is idempotent where it may be repeated: a rollout batch is a pure function of the
weights and the batch, so asking again after a lost answer gives the same tokens.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import struct
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dcr.errors import ConfigError, DcrError

__all__ = ["RAY_ENGINE", "EngineClient", "EngineUnavailable", "tokens_digest"]

RAY_ENGINE = "ray:"
"""``ray:NAMESPACE/FLEET/ENGINE``: the engine ``ENGINE`` of the fleet ``FLEET`` on Ray, its URL
in the fleet's directory actor (in Ray namespace ``NAMESPACE``)."""


class EngineUnavailable(DcrError):
    """The engine did not answer within the client's patience."""


def tokens_digest(sequences: Sequence[Sequence[int]]) -> str:
    """SHA-256 of token ids, sequence by sequence in order: each sequence as its length and
    then its ids, all little-endian uint32 (what ``tokens_sha256`` of ``dcr rl`` digests)."""
    h = hashlib.sha256()
    for seq in sequences:
        h.update(struct.pack("<I", len(seq)))
        h.update(struct.pack(f"<{len(seq)}I", *(int(t) for t in seq)))
    return h.hexdigest()


@dataclass(slots=True)
class EngineClient:
    """Calls the engine whose ready file is ``ready_file`` (or, ``ray:NAMESPACE/FLEET/ENGINE``,
    the engine actor of a fleet on Ray); waits up to ``wait_s`` for it to (re)start, retrying
    every ``retry_s``."""

    ready_file: Path
    wait_s: float = 900.0
    retry_s: float = 0.5
    call_timeout_s: float = 600.0
    _url: str | None = None

    def url(self) -> str:
        """The engine's URL, read from its ready file or the fleet's directory on Ray (waiting
        for one)."""
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                url = self._lookup()
                self._url = url
                return url
            except (OSError, ValueError, KeyError, TypeError):
                if time.monotonic() > deadline:
                    raise EngineUnavailable(
                        f"no engine wrote {self.ready_file} within {self.wait_s:.0f} s",
                        check="engine",
                    ) from None
                time.sleep(self.retry_s)

    def _lookup(self) -> str:
        where = str(self.ready_file)
        if not where.startswith(RAY_ENGINE):
            return str(json.loads(self.ready_file.read_text())["url"])
        from dcr.ray.fleet import engine_url

        namespace, fleet, engine = where.removeprefix(RAY_ENGINE).split("/")
        url = engine_url(fleet, engine, namespace=namespace)
        if url is None:
            raise KeyError(engine)  # not serving yet
        return url

    def _open(self, path: str, body: dict[str, Any] | None) -> Any:
        """The engine's open answer to ``GET`` (no body) or ``POST`` ``path``, the connection
        retried through engine restarts (a restarted engine listens elsewhere: its ready file
        says where) until ``wait_s``.  An answer the engine refused (4xx, 5xx) raises
        :class:`~dcr.errors.ConfigError` with its message."""
        deadline = time.monotonic() + self.wait_s
        data = None if body is None else json.dumps(body).encode()
        while True:
            url = self._url or self.url()
            request = urllib.request.Request(
                url + path, data=data, method="POST" if data is not None else "GET"
            )
            request.add_header("Content-Type", "application/json")
            try:
                return urllib.request.urlopen(request, timeout=self.call_timeout_s)
            except urllib.error.HTTPError as exc:
                detail = exc.read().decode(errors="replace")[:2000]
                raise ConfigError(
                    f"the engine answered {exc.code} to {path}: {detail}", check="engine"
                ) from exc
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as exc:
                if time.monotonic() > deadline:
                    raise EngineUnavailable(
                        f"the engine did not answer {path} within {self.wait_s:.0f} s: {exc}",
                        check="engine",
                    ) from exc
                self._url = None
                time.sleep(self.retry_s)

    def call(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """``GET`` (no body) or ``POST`` ``path``: the engine's JSON answer (see
        :meth:`_open`)."""
        with self._open(path, body) as response:
            result: dict[str, Any] = json.loads(response.read())
            return result

    def generate_batch(
        self,
        requests: Sequence[dict[str, Any]],
        *,
        accepted: Callable[[], None] | None = None,
    ) -> list[dict[str, Any]]:
        """One batch of requests, submitted together; the results in request order.

        ``accepted`` is called once the engine holds every request of the batch (its
        streamed answer's first line), before they are generated."""
        if accepted is None:
            results: list[dict[str, Any]] = self.call(
                "/generate_batch", {"requests": list(requests)}
            )["results"]
            return results
        lines = self.stream("/generate_batch", {"requests": list(requests), "stream": True})
        first = next(lines)
        if "accepted" not in first:
            raise ConfigError(f"the engine answered {first} instead of accepting the batch")
        accepted()
        last = next(lines)
        if "results" not in last:
            raise ConfigError(f"the engine could not run the batch: {last.get('error', last)}")
        streamed: list[dict[str, Any]] = last["results"]
        return streamed

    def stream(self, path: str, body: dict[str, Any]) -> Any:
        """``POST`` ``path`` and yield the JSON lines of the answer as they come (the
        connection retried through an engine restart until it opens)."""
        response = self._open(path, body)

        def lines() -> Any:
            with response:
                for raw in response:
                    if raw.strip():
                        yield json.loads(raw)

        return lines()

    def rollouts(
        self,
        requests: Sequence[dict[str, Any]],
        version: int,
        *,
        waiting: Callable[[str], None] | None = None,
        accepted: Callable[[], None] | None = None,
    ) -> list[dict[str, Any]]:
        """The batch as generated by committed version ``version`` -- every request's tokens
        produced by that version and no other.  A batch answered by another version (an
        engine still restoring, one behind, one straddling a refit) is asked again until the
        engine serves ``version``, bounded by ``wait_s``; a version that moved past it cannot
        come back and raises :class:`EngineUnavailable`."""
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                results = self.generate_batch(requests, accepted=accepted)
            except (OSError, http.client.HTTPException, StopIteration, ValueError) as exc:
                # The engine died while it generated the batch: ask again once it is back.
                if time.monotonic() > deadline:
                    raise EngineUnavailable(
                        f"no rollouts within {self.wait_s:.0f} s: {exc}", check="engine"
                    ) from exc
                self._url = None
                time.sleep(self.retry_s)
                continue
            finally:
                accepted = None  # a batch asked again runs on what the engine holds then
            versions = {r.get("version") for r in results}
            if versions == {version}:
                return results
            newer = [v for v in versions if isinstance(v, int) and v > version]
            if newer or time.monotonic() > deadline:
                raise EngineUnavailable(
                    f"the engine served versions {sorted(map(str, versions))}, not {version}",
                    check="version",
                )
            if waiting is not None:
                waiting(f"rollouts came from versions {sorted(map(str, versions))}; waiting "
                        f"for version {version}")  # fmt: skip
            time.sleep(self.retry_s)

    def load(self, checkpoint: Path, version: int) -> dict[str, Any]:
        """Dense refit: the engine loads the full checkpoint through vLLM's own loader."""
        return self.call("/dcr/load", {"checkpoint": str(checkpoint), "version": version})

    def state(self) -> dict[str, Any]:
        return self.call("/dcr/state")

    def digest(self) -> dict[str, Any]:
        """``{"sha256", ...}`` of the stored bits of every worker's parameters and buffers."""
        return self.call("/dcr/digest")

    def gate_closed_s(self, version: int, *, wait_s: float = 10.0) -> float | None:
        """Seconds the engine's gate admitted no request for the refit to ``version`` (every
        closing that ended at that version), or ``None`` when the engine does not say.  The
        gate reopens just after the commit: wait (up to ``wait_s``) for it."""
        deadline = time.monotonic() + wait_s
        while True:
            cycles = self.state().get("cycles")
            if not isinstance(cycles, list):
                return None
            closed = [float(c["closed_s"]) for c in cycles
                      if isinstance(c, dict) and c.get("version") == version]  # fmt: skip
            if closed or time.monotonic() > deadline:
                return sum(closed) if closed else None
            time.sleep(0.05)
