"""``python -m dcr.integrations.vllm``: a vLLM engine process whose workers are fleet receivers
(or, without ``--fleet``, a reference engine whose weights are reloaded from full checkpoints).

It starts an ``AsyncLLM`` with the dcr worker extension (and, with ``--plain-weights``, the
CPU plain-weights load format), has its workers join the fleet of ``--fleet`` as receivers
``--receivers`` (one per worker rank), and serves token-in/token-out HTTP on 127.0.0.1:

``POST /generate``
    ``{"prompt_token_ids": [...], "max_tokens": 16, "ignore_eos": false, "logprobs": true,
    "request_id": optional, "stream": false}`` (greedy) -> ``{"request_id", "token_ids",
    "logprobs", "finish_reason", "version", "candidate", "weight_versions": [{"version",
    "candidate", "start", "end"}], "switches"}``: which committed version produced which
    output tokens; ``switches`` lists the token indices where the weights changed under a
    request that straddled a refit.  While the request gate is closed, requests wait.  With
    ``"stream": true`` the answer is JSON lines: ``{"tokens": n}`` as tokens come, then
    ``{"result": {...}}``.
``POST /generate_batch``
    ``{"requests": [{"prompt_token_ids": [...], "max_tokens": 16, "temperature": 1.0,
    "top_p": 1.0, "seed": 7, "ignore_eos": false}, ...]}`` (``top_p`` and ``ignore_eos``
    optional; at most 1024 requests) -> ``{"results": [...]}``, one ``/generate`` answer per
    request, in request order.  With ``"stream": true`` the answer is JSON lines:
    ``{"accepted": n}`` once the engine holds every request of the batch (it then runs on
    the weights the engine holds now), then ``{"results": [...]}`` (or ``{"error"}``).
    The requests are sampled, each with its own seed, and enter
    the scheduler together (the engine pauses until the requests in flight finished, takes
    them all, resumes; see :func:`~dcr.integrations.vllm.generation.generate_batch`): with the
    same weights, the same batch gives the same tokens and log probabilities in any engine
    process.  A malformed batch answers 400 and adds nothing.
``POST /abort``
    ``{"request_id": ...}``: the request ends now; its answer says what it generated, with
    ``finish_reason`` ``"abort"`` and its weight versions.
``POST /dcr/load``
    ``{"checkpoint": DIR, "version": n}``: only without ``--fleet``.  Loads the full
    checkpoint directory ``DIR`` (as this process sees it) through the workers' own
    ``model.load_weights`` once requests in flight finished, drops the caches and labels the
    weights ``(n, dense-<n>)`` -> ``{"version", "candidate", "tensors", "seconds",
    "load_seconds"}`` (see :func:`~dcr.integrations.vllm.checkpoint.load_checkpoint`).  A missing
    or malformed checkpoint, or one whose tensors differ from those of ``--model``, answers
    400 and leaves the weights as they were; an engine whose workers are fleet receivers or
    whose weights were repacked (no ``--plain-weights`` on CPU) answers 409; a failure after
    writing began answers 500 (the weights then report no version until a load succeeds).
``GET /dcr/digest``
    ``{"sha256", "ranks", "rank_sha256"}``: SHA-256 over the stored bits of every parameter
    and buffer of every worker, computed in the workers (defined in
    :func:`~dcr.integrations.vllm.checkpoint.weights_digest`).
``GET /dcr/state``
    the engine's gate (closed, by which ranks, each closing's drain and closed seconds, the
    record the weights are labelled with; without ``--fleet``, each dense load's) and each
    worker's receiver status.  Without ``--fleet``, ``repacked`` lists per worker the modules
    whose weights the CPU backend repacked, with the reason (empty where the engine computes
    with its plain parameters: ``/dcr/load`` then works).  Whether vLLM repacks depends on the
    CPU: where its packed GEMM kernels cannot be built it keeps ``F.linear`` on the plain
    weights.
``GET /dcr/parameters``
    only with ``--expose-parameters`` (or ``DCR_EXPOSE_PARAMETERS=1`` in the environment, as
    an ``[[engine]] env`` of a fleet file sets it); otherwise 404.  Every parameter and buffer
    of every worker, as base64 of its stored bytes (read through ``collective_rpc``), for
    bit-for-bit comparisons: the whole model to anyone who reaches the port, so it is off
    unless asked for.
``GET /health``

Bodies are limited to 16 MiB.  Without ``--fleet`` the engine serves the checkpoint as
loaded (a reference engine); ``--checkpoint-version N`` labels those weights ``(N,
dense-N)``, so requests report version ``N`` until the next ``/dcr/load``.
``--no-prefix-cache`` and ``--no-chunked-prefill`` turn those vLLM features off: for
reproducible batches, a batch's numerics must not depend on what earlier requests left in
the prefix cache, and on CPU a seeded request must not have its prefill split across steps.
``--catalog DIR`` gives the receivers the catalog of that checkpoint directory instead of the
fleet file's.  Once it serves, the process writes ``{"url", "pid"}`` to ``--ready-file`` if
given.  SIGTERM or SIGINT stop it: the receivers leave, the engine shuts down.  With
``--stop-with-parent`` (what ``dcr fleet`` passes) the process kills itself and its engine
-- its whole process group when it leads one -- as soon as the process that started it is
gone, whatever it is doing then (starting the engine included).  When the workers cannot join
(for example weights repacked by the CPU backend without ``--plain-weights``, or a catalog
that does not fit the model) it prints the error and exits with status 1.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from dcr.errors import ConfigError, DcrError, LoaderPathUnsupported
from dcr.fleet.config import FleetConfig
from dcr.integrations.vllm.gate import PAUSE_MODES, PauseMode

__all__ = ["EXPOSE_PARAMETERS_ENV", "MAX_BATCH", "MAX_BODY_BYTES", "ServerOptions", "main", "serve"]

MAX_BATCH = 1024
"""Most requests one ``POST /generate_batch`` may carry."""

MAX_BODY_BYTES = 16 << 20
"""Largest request body the server reads (larger ones answer 413)."""

EXPOSE_PARAMETERS_ENV = "DCR_EXPOSE_PARAMETERS"
"""``1`` in the engine process's environment: as ``--expose-parameters``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerOptions:
    """What the engine process serves and how it joins the fleet."""

    model: str
    tensor_parallel_size: int = 1
    dtype: str = "bfloat16"
    max_model_len: int | None = None
    enforce_eager: bool = True
    plain_weights: bool = False
    fleet: str | FleetConfig | None = None
    """The fleet file whose receivers the workers become, or its config (on Ray: the
    config :func:`dcr.ray.fleet_config` gives, relay addresses included)."""
    receivers: tuple[str, ...] = ()
    checkpoint_version: int | None = None
    catalog: str | None = None
    """Checkpoint directory whose catalog the receivers take (default: the fleet file's)."""
    report_fingerprints: bool = False
    pause_mode: PauseMode | None = None
    prefix_caching: bool = True
    """``False``: the engine runs without vLLM's prefix cache."""
    chunked_prefill: bool = True
    """``False``: the engine never splits a prefill across scheduler steps."""
    host: str = "127.0.0.1"
    port: int = 0
    ready_file: str | None = None
    expose_parameters: bool = False
    """Serve ``GET /dcr/parameters`` (every weight's bytes); off: that route answers 404."""
    on_serving: Callable[[str], None] | None = None
    """Called with the URL once the engine serves (where a Ray actor registers it)."""


def _bad_request(message: str) -> Any:
    from aiohttp import web

    return web.json_response({"error": message}, status=400)


def _error(message: str, status: int) -> Any:
    from aiohttp import web

    return web.json_response({"error": message}, status=status)


def _batch_requests(body: object) -> list[Any]:
    """The requests of a ``/generate_batch`` body, each checked strictly."""
    from dcr.integrations.vllm.generation import BatchRequest

    if not isinstance(body, dict):
        raise ConfigError("the request body must be a JSON object")
    unknown = sorted(set(body) - {"requests"})
    if unknown:
        raise ConfigError(f'unknown fields {unknown}: the body is {{"requests": [...]}}')
    raw = body.get("requests")
    if not isinstance(raw, list) or not raw:
        raise ConfigError("requests must be a non-empty list of request objects")
    if len(raw) > MAX_BATCH:
        raise ConfigError(f"a batch holds at most {MAX_BATCH} requests, got {len(raw)}")
    out = []
    for i, item in enumerate(raw):
        try:
            out.append(BatchRequest.from_dict(item))
        except ConfigError as exc:
            raise ConfigError(f"request {i}: {exc.message}") from exc
    return out


def _load_request(body: object) -> tuple[str, int]:
    """``(checkpoint, version)`` of a ``/dcr/load`` body, checked strictly."""
    if not isinstance(body, dict):
        raise ConfigError("the request body must be a JSON object")
    unknown = sorted(set(body) - {"checkpoint", "version"})
    if unknown:
        raise ConfigError(f'unknown fields {unknown}: the body is {{"checkpoint", "version"}}')
    checkpoint, version = body.get("checkpoint"), body.get("version")
    if not isinstance(checkpoint, str) or not checkpoint:
        raise ConfigError("checkpoint must be a non-empty string: a checkpoint directory")
    if type(version) is not int or version < 0:
        raise ConfigError(f"version must be a non-negative integer, got {version!r}")
    return checkpoint, version


def _int_list(raw: object, what: str) -> list[int]:
    if not isinstance(raw, list) or not raw or not all(type(t) is int and t >= 0 for t in raw):
        raise ConfigError(f"{what} must be a non-empty list of non-negative integers")
    return list(raw)


async def serve(options: ServerOptions) -> None:
    """Run the engine process until cancelled."""
    from aiohttp import web
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from dcr.integrations.vllm import EXTENSION, PLAIN_WEIGHTS
    from dcr.integrations.vllm.checkpoint import PARTIAL_LOAD, load_checkpoint, weights_digest
    from dcr.integrations.vllm.engine import EngineReceivers, gate_of, join_fleet
    from dcr.integrations.vllm.generation import generate, generate_batch
    from dcr.integrations.vllm.versions import dense_record

    load_format = "auto"
    if options.plain_weights:
        import dcr.integrations.vllm.plain  # noqa: F401  (the load format, in this process too)

        load_format = PLAIN_WEIGHTS
    engine = AsyncLLM.from_engine_args(
        AsyncEngineArgs(
            model=options.model,
            tensor_parallel_size=options.tensor_parallel_size,
            dtype=options.dtype,
            max_model_len=options.max_model_len,
            enforce_eager=options.enforce_eager,
            skip_tokenizer_init=True,
            worker_extension_cls=EXTENSION,
            load_format=load_format,
            # One worker lives in the engine-core process (one process less to start).
            distributed_executor_backend="uni" if options.tensor_parallel_size == 1 else "mp",
            # None: vLLM's default for the model and platform.
            enable_prefix_caching=None if options.prefix_caching else False,
            enable_chunked_prefill=None if options.chunked_prefill else False,
        )
    )
    receivers: EngineReceivers | None = None

    async def generate_route(request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ConfigError("the request body must be a JSON object")
            prompt = _int_list(body.get("prompt_token_ids"), "prompt_token_ids")
            max_tokens = body.get("max_tokens", 16)
            if type(max_tokens) is not int or max_tokens < 1:
                raise ConfigError("max_tokens must be a positive integer")
            flags = {k: body.get(k, k == "logprobs") for k in ("ignore_eos", "logprobs", "stream")}
            if not all(isinstance(v, bool) for v in flags.values()):
                raise ConfigError("ignore_eos, logprobs and stream must be true or false")
            request_id = body.get("request_id")
            if request_id is not None and (not isinstance(request_id, str) or not request_id):
                raise ConfigError("request_id must be a non-empty string")
        except (ValueError, ConfigError) as exc:
            return _bad_request(str(exc))  # type: ignore[no-any-return]
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0,
            ignore_eos=flags["ignore_eos"],
            logprobs=0 if flags["logprobs"] else None,
            detokenize=False,
        )
        if not flags["stream"]:
            out = await generate(engine, prompt, params, request_id=request_id)
            return web.json_response(out.as_dict())
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await response.prepare(request)

        async def progress(tokens: int) -> None:
            await response.write(json.dumps({"tokens": tokens}).encode() + b"\n")

        out = await generate(engine, prompt, params, request_id=request_id, progress=progress)
        await response.write(json.dumps({"result": out.as_dict()}).encode() + b"\n")
        await response.write_eof()
        return response

    async def generate_batch_route(request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
            stream = isinstance(body, dict) and body.pop("stream", False)
            if not isinstance(stream, bool):
                raise ConfigError("stream must be true or false")
            batch = _batch_requests(body)
            gate = receivers.gate if receivers is not None else gate_of(engine)
            if not stream:
                results = await generate_batch(engine, batch, gate=gate)
                return web.json_response({"results": [g.as_dict() for g in results]})
        except (ValueError, ConfigError) as exc:
            return _bad_request(str(exc))  # type: ignore[no-any-return]
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await response.prepare(request)

        async def admitted() -> None:
            await response.write(json.dumps({"accepted": len(batch)}).encode() + b"\n")

        line: dict[str, Any]
        try:
            results = await generate_batch(engine, batch, gate=gate, admitted=admitted)
            line = {"results": [g.as_dict() for g in results]}
        except ConfigError as exc:
            line = {"error": str(exc)}
        await response.write(json.dumps(line).encode() + b"\n")
        await response.write_eof()
        return response

    async def load_route(request: web.Request) -> web.Response:
        if receivers is not None:
            message = "the engine's workers are fleet receivers: its weights change by refits"
            return _error(message, 409)  # type: ignore[no-any-return]
        try:
            checkpoint, version = _load_request(await request.json())
        except (ValueError, ConfigError) as exc:
            return _bad_request(str(exc))  # type: ignore[no-any-return]
        try:
            loaded = await load_checkpoint(engine, checkpoint, version, gate=gate_of(engine))
        except LoaderPathUnsupported as exc:
            return _error(str(exc), 409)  # type: ignore[no-any-return]
        except DcrError as exc:
            status = {PARTIAL_LOAD: 500, "fleet": 409}.get(exc.check or "", 400)
            return _error(str(exc), status)  # type: ignore[no-any-return]
        return web.json_response(loaded.as_dict())

    async def digest_route(request: web.Request) -> web.Response:
        return web.json_response((await weights_digest(engine)).as_dict())

    async def abort_route(request: web.Request) -> web.Response:
        try:
            body = await request.json()
            request_id = body.get("request_id") if isinstance(body, dict) else None
            if not isinstance(request_id, str) or not request_id:
                raise ConfigError("request_id must be a non-empty string")
        except (ValueError, ConfigError) as exc:
            return _bad_request(str(exc))  # type: ignore[no-any-return]
        await engine.abort(request_id)
        return web.json_response({"aborted": request_id})

    async def state_route(request: web.Request) -> web.Response:
        state: dict[str, Any] = {"weight_version": await engine.get_weight_version()}
        if receivers is not None:
            state.update(receivers.state(), workers=await receivers.status())
        else:
            state.update(gate_of(engine).state())
            state["repacked"] = await engine.collective_rpc("dcr_repacked")
        return web.json_response(state)

    async def parameters_route(request: web.Request) -> web.Response:
        ranks = await engine.collective_rpc("dcr_parameters")
        return web.json_response(
            {
                "ranks": [
                    {
                        name: {
                            "dtype": dtype,
                            "shape": list(shape),
                            "bits": base64.b64encode(data).decode(),
                        }
                        for name, (dtype, shape, data) in rank.items()
                    }
                    for rank in ranks
                ]
            }
        )

    async def health_route(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app.router.add_post("/generate", generate_route)
    app.router.add_post("/generate_batch", generate_batch_route)
    app.router.add_post("/abort", abort_route)
    app.router.add_post("/dcr/load", load_route)
    app.router.add_get("/dcr/digest", digest_route)
    app.router.add_get("/dcr/state", state_route)
    if options.expose_parameters:
        app.router.add_get("/dcr/parameters", parameters_route)
    app.router.add_get("/health", health_route)
    runner = web.AppRunner(app, handle_signals=False)
    try:
        async with AsyncExitStack() as stack:
            if options.fleet is not None:
                receivers = await stack.enter_async_context(
                    join_fleet(
                        engine,
                        options.fleet,
                        options.receivers,
                        checkpoint_version=options.checkpoint_version,
                        checkpoint=options.catalog,
                        pause_mode=options.pause_mode,
                        report_fingerprints=options.report_fingerprints,
                    )
                )
                for line in receivers.describe():
                    print(f"dcr: {line}", file=sys.stderr, flush=True)
            elif options.checkpoint_version is not None:
                await gate_of(engine).label(dense_record(options.checkpoint_version))
            await runner.setup()
            stack.push_async_callback(runner.cleanup)
            site = web.TCPSite(runner, options.host, options.port)
            await site.start()
            host, port = runner.addresses[0][:2]
            if options.ready_file is not None:
                ready = Path(options.ready_file)
                tmp = ready.with_name(ready.name + ".tmp")
                tmp.write_text(json.dumps({"url": f"http://{host}:{port}", "pid": os.getpid()}))
                tmp.replace(ready)
            if options.on_serving is not None:
                options.on_serving(f"http://{host}:{port}")
            await anyio.sleep_forever()
    finally:
        engine.shutdown()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dcr.integrations.vllm",
        description="a vLLM engine over HTTP whose workers are dcr receivers of a fleet "
        "(--fleet) or, without one, a reference engine that loads full checkpoints (/dcr/load)",
    )
    p.add_argument("--model", required=True, help="checkpoint directory (Hugging Face layout)")
    p.add_argument("--tp", type=int, default=1, help="tensor parallelism: workers and receivers")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, help="default: what the model config allows")
    p.add_argument(
        "--plain-weights",
        action="store_true",
        help="CPU: keep the weights plain (load_format=dcr_plain) so in-place refit is exact",
    )
    p.add_argument("--fleet", help="fleet file whose receivers the workers become")
    p.add_argument("--receivers", default="", help="receiver names, one per worker rank: r0,r1")
    p.add_argument(
        "--checkpoint-version",
        type=int,
        help="the version whose checkpoint --model is; with --fleet: if committed, join without "
        "a dense refit; without: requests report it (as (N, dense-N)) until /dcr/load",
    )
    p.add_argument(
        "--catalog",
        help="checkpoint directory whose safetensors headers give the receivers' catalog "
        "(default: the fleet file's [model])",
    )
    p.add_argument(
        "--report-fingerprints",
        action="store_true",
        help="report the fingerprint of every version the workers hold (dcr fleet checks it)",
    )
    p.add_argument(
        "--stop-with-parent",
        action="store_true",
        help="kill this process and its engine once the process that started it is gone",
    )
    p.add_argument("--pause-mode", choices=PAUSE_MODES, help="how the gate pauses the engine")
    p.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="run without vLLM's prefix cache (a batch's numerics then never depend on what "
        "earlier requests cached)",
    )
    p.add_argument(
        "--no-chunked-prefill",
        action="store_true",
        help="never split a prefill across steps (on CPU, vLLM 0.32 fails seeded requests "
        "whose prefill it splits)",
    )
    p.add_argument(
        "--expose-parameters",
        action="store_true",
        default=os.environ.get(EXPOSE_PARAMETERS_ENV) == "1",
        help="serve GET /dcr/parameters: every weight's stored bytes, for bit-for-bit checks "
        f"(default: off, 404; {EXPOSE_PARAMETERS_ENV}=1 in the environment turns it on too)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0: any free port")
    p.add_argument("--ready-file", help="write {url, pid} here once serving")
    return p


_PARENT_POLL_S = 0.2


def _stop_with_parent() -> None:
    """Watch the parent from a daemon thread; once this process is orphaned, SIGKILL its
    process group when it leads one (the engine core and workers are in it), else itself.

    ``PR_SET_PDEATHSIG`` would reach this process only, not the engine processes vLLM starts,
    and a signal arriving while the engine starts is not handled; the group kill is."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(_PARENT_POLL_S)
        if os.getpgid(0) == os.getpid():
            os.killpg(os.getpid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    if parent == 1:  # already orphaned
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=watch, name="dcr-stop-with-parent", daemon=True).start()


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.stop_with_parent:
        _stop_with_parent()
    receivers = tuple(n for n in args.receivers.split(",") if n)
    if args.fleet is not None and len(receivers) != args.tp:
        print(f"--receivers needs {args.tp} names (one per worker rank)", file=sys.stderr)
        return 2
    options = ServerOptions(
        model=args.model,
        tensor_parallel_size=args.tp,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        plain_weights=args.plain_weights,
        fleet=args.fleet,
        receivers=receivers,
        checkpoint_version=args.checkpoint_version,
        catalog=args.catalog,
        report_fingerprints=args.report_fingerprints,
        pause_mode=args.pause_mode,
        prefix_caching=not args.no_prefix_cache,
        chunked_prefill=not args.no_chunked_prefill,
        host=args.host,
        port=args.port,
        ready_file=args.ready_file,
        expose_parameters=args.expose_parameters,
    )

    failure: list[DcrError] = []

    async def run() -> None:
        async with anyio.create_task_group() as tg:

            async def stop_on_signal() -> None:
                with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                    async for _ in signals:
                        tg.cancel_scope.cancel()
                        return

            tg.start_soon(stop_on_signal)
            try:
                await serve(options)
            except DcrError as exc:
                failure.append(exc)
                tg.cancel_scope.cancel()

    anyio.run(run, backend="asyncio")
    if failure:
        exc = failure[0]
        print(
            f"dcr: the engine cannot join the fleet: {type(exc).__name__}: {exc}", file=sys.stderr
        )
        return 1
    return 0
