"""A dcr receiver in every worker of a running vLLM engine (``worker_extension_cls``).

vLLM mixes :class:`DcrWorkerExtension` into each worker class when the engine is started
with ``worker_extension_cls=`` :data:`~dcr.integrations.vllm.EXTENSION`; the engine process
then drives it with ``collective_rpc`` (see :mod:`dcr.integrations.vllm.engine`).
``dcr_join`` wraps the worker's model and its native ``load_weights`` in a
:class:`~dcr.apply.applier.Applier` over the fleet's catalog (the fleet file's, or read from
the checkpoint directory the join names) and prewarms it in place: it refuses weights the CPU
backend repacked and a catalog that does not fit the model (a tensor the model cannot load, a
parameter no tensor writes).  It then starts, on an event loop in a thread of its own, the
fleet receiver of this
rank (:func:`dcr.fleet.receiver.run_receiver`): ZeroMQ control to the coordinator, the relay
tree of its host for payloads, decode and in-place apply in this process.  Its request-gate
hooks call the engine process's gate (:mod:`dcr.integrations.vllm.gate`), so writes into the
weights happen only while that gate holds the engine paused.

Outside any fleet, the same extension serves a reference engine: ``dcr_check_checkpoint`` and
``dcr_load_checkpoint`` load a full checkpoint through the model's own ``load_weights``
(:func:`~dcr.integrations.vllm.checkpoint.load_checkpoint`), and ``dcr_digest`` hashes the stored
bits of the worker's weights (:func:`~dcr.integrations.vllm.checkpoint.weights_digest`).

vLLM resolves the extension class before the worker loads its model, so importing this
module is also where every worker learns the plain-weights load format
(:mod:`dcr.integrations.vllm.plain`).
"""

from __future__ import annotations

import hashlib
import logging
import struct
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from contextlib import AbstractContextManager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dcr.alloc import keep_freed_memory
from dcr.errors import CheckpointError, ConfigError, DcrError, LoaderPathUnsupported
from dcr.integrations.vllm import plain  # noqa: F401  (registers the load format here)
from dcr.integrations.vllm.join import JoinSpec, error_to_wire
from dcr.protocol.types import CommitRecord

if TYPE_CHECKING:
    from dcr.apply.applier import Applier
    from dcr.fleet.config import FleetConfig
    from dcr.tensors.records import TensorSpec

__all__ = ["DcrWorkerExtension"]


_START_TIMEOUT_S = 120.0
_log = logging.getLogger(__name__)


class _Hosted:
    """The receiver this worker hosts: its event-loop thread and its service."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.service: Any = None
        self.started = threading.Event()
        self.portal_cm: AbstractContextManager[Any] | None = None
        self.portal: Any = None
        self.future: Future[Any] | None = None

    def on_started(self, service: Any) -> None:
        self.service = service
        self.started.set()

    def stop(self) -> None:
        if self.future is not None and not self.future.done():
            self.future.cancel()
        if self.portal_cm is not None:
            self.portal_cm.__exit__(None, None, None)
            self.portal_cm = None


def _report_end(name: str) -> Callable[[Future[Any]], None]:
    """A callback that logs how receiver ``name``'s service ended, unless it was stopped."""

    def report(future: Future[Any]) -> None:
        if future.cancelled():
            return
        failure = future.exception()
        if failure is not None:
            _log.error("dcr receiver %s stopped: %r", name, failure, exc_info=failure)

    return report


class DcrWorkerExtension:
    """Methods vLLM adds to every worker; the engine process calls them by name through
    ``collective_rpc`` (every worker runs each call, and each serves its own rank)."""

    _dcr_hosted: _Hosted | None = None
    _dcr_catalog: dict[str, TensorSpec] | None = None
    """The catalog of the checkpoint the engine was started from (read on first use)."""

    def dcr_join(self, spec: Mapping[str, Any]) -> dict[str, Any]:
        """Prewarm a receiver around this worker's model and start serving the fleet.

        Returns ``{"name", "prewarm"}``, or ``{"error"}`` (a dcr error as data) when the
        model cannot take in-place refits or the fleet file does not fit the engine.
        """
        keep_freed_memory()
        try:
            return self._dcr_join(JoinSpec.from_wire(spec))
        except DcrError as exc:
            return {"error": error_to_wire(exc)}

    def dcr_leave(self) -> bool:
        """Stop this worker's receiver (its sockets close); ``False`` if none ran."""
        hosted = self._dcr_hosted
        if hosted is None:
            return False
        hosted.stop()
        self._dcr_hosted = None
        return True

    def dcr_status(self) -> dict[str, Any] | None:
        """What this worker's receiver holds and did (``None`` before it joined)."""
        hosted = self._dcr_hosted
        if hosted is None or hosted.service is None:
            return None
        service = hosted.service

        def read() -> dict[str, Any]:
            held = service.core.held
            ended = hosted.future is not None and hosted.future.done()
            failure = None
            if ended and hosted.future is not None and not hosted.future.cancelled():
                failure = hosted.future.exception()
            return {
                "name": hosted.name,
                "serving": not ended,
                "error": None if failure is None else repr(failure),
                "phase": service.core.phase.value,
                "held": None if held is None else [held.version, held.candidate],
                "dirty": service.core.dirty,
                "gate_open": service.core.gate_open,
                "applied_payloads": service.applied_payloads,
                "decode_seconds": service.decode_seconds,
                "apply_seconds": service.apply_seconds,
                "incarnation": service.incarnation,
            }

        result: dict[str, Any] = hosted.portal.call(read)
        return result

    def dcr_parameters(self) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
        """Every parameter and buffer of this worker's model (under every name it has) as
        ``(dtype, shape, stored bytes)``, for bit-for-bit comparisons."""
        from dcr.tensors.bits import bits, dtype_name

        model = self._dcr_model()
        out = {}
        for name, t in [
            *model.named_parameters(remove_duplicate=False),
            *model.named_buffers(remove_duplicate=False),
        ]:
            data = t.detach().cpu().contiguous()
            out[name] = (dtype_name(data.dtype), tuple(data.shape), bits(data).tobytes())
        return out

    def dcr_digest(self) -> str:
        """SHA-256 (hex) of this worker's parameters and buffers, as
        :func:`~dcr.integrations.vllm.checkpoint.weights_digest` defines it: in sorted name order
        (``remove_duplicate=False``), for each ``"<name>\\0<dtype>\\0<shape, comma-separated>\\0"``
        in UTF-8, the data's byte count (8 bytes, little-endian), then its stored bytes."""
        import torch

        from dcr.tensors.bits import dtype_name

        model = self._dcr_model()
        tensors = dict(
            [
                *model.named_parameters(remove_duplicate=False),
                *model.named_buffers(remove_duplicate=False),
            ]
        )
        digest = hashlib.sha256()
        for name in sorted(tensors):
            data = tensors[name].detach().cpu().contiguous()
            shape = ",".join(str(d) for d in data.shape)
            raw = data.reshape(-1).view(torch.uint8).numpy()
            digest.update(f"{name}\0{dtype_name(data.dtype)}\0{shape}\0".encode())
            digest.update(struct.pack("<Q", raw.nbytes))
            digest.update(raw.data)
        return digest.hexdigest()

    def dcr_check_checkpoint(self, path: str) -> dict[str, Any]:
        """Check, without writing anything, that this worker can load the full checkpoint
        directory ``path`` (:meth:`dcr_load_checkpoint`).  Returns ``{"tensors"}`` or
        ``{"error"}``."""
        try:
            return {"tensors": len(self._dcr_checkpoint_files(path)[1])}
        except DcrError as exc:
            return {"error": error_to_wire(exc)}

    def dcr_load_checkpoint(self, path: str) -> dict[str, Any]:
        """Load the full Hugging Face checkpoint directory ``path`` into this worker's model
        through its own ``model.load_weights``, as the engine's dense load does.

        The directory's ``*.safetensors`` files are read with the ``safetensors`` library
        (never ``torch.load``: nothing is unpickled), one tensor at a time, in file order.
        Before anything is written the checkpoint is checked: this worker hosts no fleet
        receiver (whose refits own the weights), its weights were not repacked by the CPU
        backend (:func:`~dcr.adapters.loaders.vllm.find_repacked`: the engine must run the
        plain-weights load format on CPU), the headers are valid, and the names, shapes and
        dtypes of the tensors and the model type equal those of the checkpoint the engine
        was started from.  Returns ``{"tensors", "seconds", "written": true}``, or
        ``{"error", "written"}`` (``written``: whether the failure came after writing began).
        """
        try:
            files, catalog = self._dcr_checkpoint_files(path)
        except DcrError as exc:
            return {"error": error_to_wire(exc), "written": False}
        from vllm.config import set_current_vllm_config

        from dcr.adapters.loaders.vllm import VllmLoader

        model = self._dcr_model()
        count = 0

        def weights() -> Iterator[tuple[str, Any]]:
            nonlocal count
            from safetensors import safe_open

            for file in files:
                with safe_open(str(file), framework="pt", device="cpu") as f:
                    for name in f.keys():  # noqa: SIM118  (safe_open has no __iter__)
                        count += 1
                        yield name, f.get_tensor(name)

        t0 = time.monotonic()
        try:
            with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
                loaded = VllmLoader(model).load_weights(weights())
            if count != len(catalog):
                raise CheckpointError(
                    f"{path}: {count} tensors read, the catalog lists {len(catalog)}",
                    check="missing",
                )
            if loaded is not None:
                missing = sorted({n for n, _ in model.named_parameters()} - loaded)
                if missing:
                    raise ConfigError(
                        f"{path}: load_weights did not load {len(missing)} parameters "
                        f"({', '.join(missing[:3])})",
                        tensor=missing[0],
                        check="catalog",
                    )
        except DcrError as exc:
            return {"error": error_to_wire(exc), "written": True}
        except Exception as exc:  # a file that changed under the check (safetensors' errors)
            error = CheckpointError(f"{path}: cannot be read: {exc!r}", check="read")
            return {"error": error_to_wire(error), "written": True}
        return {"tensors": count, "seconds": time.monotonic() - t0, "written": True}

    def dcr_repacked(self) -> dict[str, str]:
        """Modules whose compute weights are no longer their plain parameters (see
        :func:`~dcr.adapters.loaders.vllm.find_repacked`)."""
        from dcr.adapters.loaders.vllm import find_repacked

        return find_repacked(self._dcr_model())

    # -- internals --------------------------------------------------------------------------

    def _dcr_model(self) -> Any:
        get_model: Callable[[], Any] = self.get_model  # type: ignore[attr-defined]
        return get_model()

    def _dcr_checkpoint_files(self, path: str) -> tuple[list[Path], dict[str, TensorSpec]]:
        """The safetensors files of checkpoint ``path`` and its catalog, once it is known that
        this worker can load it (see :meth:`dcr_load_checkpoint`); raises the
        :class:`~dcr.errors.DcrError` that says why not."""
        from dcr.adapters.loaders.vllm import VllmLoader
        from dcr.catalog import INDEX_FILE, check_catalog, read_catalog, read_config

        if self._dcr_hosted is not None:
            raise ConfigError(
                f"this worker hosts receiver {self._dcr_hosted.name!r} of a fleet: its weights "
                "change only by refits of that fleet",
                check="fleet",
            )
        VllmLoader(self._dcr_model()).check_ready()
        directory = Path(path)
        catalog = read_catalog(directory)
        config = read_config(directory)
        started: str = self.model_config.model  # type: ignore[attr-defined]
        if self._dcr_catalog is None:
            try:
                self._dcr_catalog = read_catalog(started)
            except CheckpointError as exc:
                raise ConfigError(
                    f"the checkpoint the engine was started from ({started}) cannot be read "
                    f"to check {directory} against it: {exc}",
                    check="catalog",
                ) from exc
        check_catalog(
            self._dcr_catalog,
            catalog,
            expected_from=f"the engine's checkpoint {started}",
            found_from=str(directory),
        )
        hf = self.model_config.hf_config  # type: ignore[attr-defined]
        for key, want in (
            ("model_type", getattr(hf, "model_type", None)),
            ("architectures", getattr(hf, "architectures", None)),
        ):
            found = config.get(key)
            if (
                want is not None
                and found is not None
                and list(_as_list(found)) != list(_as_list(want))
            ):
                raise ConfigError(
                    f"{directory}: {key} {found!r} differs from the engine's model ({want!r})",
                    check="config",
                )
        if (directory / INDEX_FILE).exists():
            names = sorted(set(_index_files(directory / INDEX_FILE)))
            files = [directory / n for n in names]
        else:
            files = sorted(directory.glob("*.safetensors"))
        return files, catalog

    def _dcr_prewarm(self, cfg: FleetConfig, threads: int | None) -> tuple[Applier, Any]:
        """A receiver around this worker's model over the fleet's catalog, prewarmed; raises
        when the catalog does not fit the model (see :func:`dcr.catalog.uncovered_parameters`)."""
        from dcr.adapters.loaders.vllm import VllmLoader
        from dcr.apply.applier import Applier, ApplyConfig
        from dcr.catalog import uncovered_parameters
        from dcr.fleet.model import FleetModel

        source = cfg.model.checkpoint or (
            f"the fleet file's [model] (the synthetic trainer's {cfg.model.family} model)"
        )
        hint = (
            "; is the catalog the checkpoint this engine serves? name it with [model] "
            "checkpoint in the fleet file, join_fleet(checkpoint=...) or --catalog DIR"
        )
        config = ApplyConfig() if threads is None else ApplyConfig(threads=threads)
        if cfg.model.fp8 is not None:
            source = f"{source} as FP8 ([model] rollout_dtype)"
        receiver = Applier(VllmLoader(self._dcr_model()), FleetModel(cfg).wire_catalog, config)
        try:
            report = receiver.prewarm()
        except LoaderPathUnsupported as exc:
            if exc.check != "native-loader":
                raise
            raise ConfigError(
                f"the catalog of {source} does not fit the engine's model: vLLM cannot load "
                f"{exc.tensor!r} ({exc.message}){hint}",
                tensor=exc.tensor,
                check="catalog",
            ) from exc
        uncovered = uncovered_parameters(receiver)
        if uncovered:
            raise ConfigError(
                f"the catalog of {source} does not fill {len(uncovered)} parameters of the "
                f"engine's model ({', '.join(uncovered[:3])}{' ...' if len(uncovered) > 3 else ''})"
                f": the model has tensors the catalog lacks, which no refit would update{hint}",
                tensor=uncovered[0],
                check="catalog",
            )
        return receiver, report

    def _dcr_join(self, spec: JoinSpec) -> dict[str, Any]:
        import anyio.from_thread

        from dcr.engine.receiver import ReceiverHooks
        from dcr.fleet.config import load_fleet
        from dcr.fleet.receiver import run_receiver
        from dcr.integrations.vllm.gate import GateClient

        if self._dcr_hosted is not None:
            raise ConfigError(f"this worker already hosts receiver {self._dcr_hosted.name!r}")
        rank: int = self.rank  # type: ignore[attr-defined]
        if len(spec.names) <= rank:
            raise ConfigError(f"no receiver name for worker rank {rank} in {list(spec.names)}")
        name = spec.names[rank]
        cfg = load_fleet(spec.fleet)
        if spec.relay_addresses:
            cfg = replace(cfg, relay_addresses=dict(spec.relay_addresses))
        if spec.checkpoint is not None:
            cfg = replace(cfg, model=replace(cfg.model, checkpoint=spec.checkpoint))
        declared = cfg.receiver(name)
        if (declared.tp, declared.rank) != (len(spec.names), rank):
            raise ConfigError(
                f"receiver {name!r} is declared as rank {declared.rank} of tp={declared.tp}, "
                f"but it runs as rank {rank} of {len(spec.names)} workers",
                check="layout",
            )
        receiver, report = self._dcr_prewarm(cfg, spec.apply_threads)

        hosted = _Hosted(name)
        gate = GateClient(spec.gate, rank, timeout_s=spec.gate_timeout_s)
        record: list[CommitRecord] = []

        async def close() -> None:
            info = hosted.service.core.attempt if hosted.service is not None else None
            await gate.call("close", sync=None if info is None else info.sync)

        async def invalidate() -> None:
            await gate.call("invalidate")

        async def reopen() -> None:
            if not record:
                raise ConfigError(f"receiver {name!r} reopened holding no committed record")
            await gate.call("open", record[-1])

        async def holds(held: CommitRecord) -> None:
            record[:] = [held]

        hooks = ReceiverHooks(
            close_gate=close, invalidate_kv_cache=invalidate, open_gate=reopen, holds=holds
        )

        # The fleet secret reaches the fleet's receiver as its fleet_secret option when given.
        sealed: dict[str, Any] = {}
        if spec.fleet_secret is not None:
            sealed["fleet_secret"] = spec.fleet_secret

        async def serve() -> None:
            try:
                await run_receiver(
                    cfg, name, receiver=receiver, hooks=hooks, held=spec.held,
                    report="fingerprint" if spec.report_fingerprints else "none",
                    started=hosted.on_started, **sealed,
                )  # fmt: skip
            finally:
                gate.close()

        hosted.portal_cm = anyio.from_thread.start_blocking_portal(backend="asyncio")
        hosted.portal = hosted.portal_cm.__enter__()
        hosted.future = hosted.portal.start_task_soon(serve)
        hosted.future.add_done_callback(_report_end(name))
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not hosted.started.wait(0.05):
            if hosted.future.done() or time.monotonic() > deadline:
                failure = None if not hosted.future.done() else hosted.future.exception()
                hosted.stop()
                if isinstance(failure, DcrError):
                    raise failure
                raise ConfigError(
                    f"receiver {name!r} did not start: {failure or 'timed out'}", check="join"
                )
        self._dcr_hosted = hosted
        return {
            "name": name,
            "prewarm": {
                "names": report.names,
                "preserving": report.preserving,
                "transforming": report.transforming,
                "skipped": report.skipped,
                "xor_allowed": report.xor_allowed,
                "refused": sorted(set(receiver.catalog) - receiver.xor_allowed())[:16],
                "seconds": report.seconds,
            },
        }


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _index_files(index: Path) -> list[str]:
    """The file names a sharded checkpoint's index maps tensors to (read_catalog checked it)."""
    import json

    weight_map: dict[str, str] = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    return list(weight_map.values())
