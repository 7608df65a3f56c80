"""End-to-end refit benchmark (paper §8.1, §8.5-8.7, Table 4, Fig. 11) in a fleet of processes.

A synthetic llama-family model of ``dcr bench construct``'s shape (bf16, at least ``size``
bytes) is trained by a multi-process trainer (one owner process per rank, gloo) and served by
receivers on several rollout nodes, each role its own OS process (:mod:`dcr.fleet`).  For each
transport -- the relay tree, S3 against a SeaweedFS server started here (127.0.0.1, a random
port, stopped at the end) and a local directory -- one fleet runs a warm-up refit and then
``repeats`` refits at each element change rate; every receiver is checked bit for bit against
a dense load of every version.  Cross-boundary traffic passes an emulated link of
``link_gbps`` per process and direction (:class:`~dcr.adapters.transport.link.LinkLimit`):
owners' uploads or sends, the relay root's receive path, rollout nodes' fetches.

**Timed window** (paper §8.1, App. C "Timed window and intervals"): from ``t0``, when the
first owner starts constructing the version (its residual steps at staging, then every
bucket), to ``t1``, when the last owner finished its baseline update after the joint commit;
it covers construction, transport, staging, apply, ACK, commit and baseline update.  Post-apply
checks are off (nothing to subtract).  Here ``t0`` is taken when the trainer hands the version
over, a little before the paper's (the coordinator's prepare falls inside the window).  The
trainer runs in lockstep: no optimizer step and no bit check runs beside a timed refit.

**Lower bounds** (paper §8.7, App. C "Lower bounds"): each is the longest union of intervals
on one endpoint, clipped to ``[t0, t1]``, overlaps counted once -- the *construction bound*
over each owner's compute intervals (residual staging; each bucket's comparison, projection,
packing, encoding and zstd), the *transport bound* over each sending endpoint's transport
intervals (a payload's submission until the transport accepted it: on the relay tree every
receiver queued it, on object storage the object and its manifest entry are stored) and, on
object storage, each rollout node's fetches (the downloads cross the boundary there).

**Where the time goes**: each refit's phases -- staging (``t0`` until every owner staged),
admission (until the first bucket's construction starts; 0 when an owner began its first
bucket ahead of the coordinator's prepare), streaming (until the last payload is applied) and
finalization (until ``t1``: synchronization, ACK, commit, baseline update) -- and the CPU
seconds each role's processes used in the window (every fleet event carries its process's CPU
clock), against the CPU seconds the machine had: their sum over the CPUs is the *CPU bound*,
below which no window on this machine can fall.

**Reference** (paper §8.1 "Reference"): the transport-only full-checkpoint transfer over the
same transport and link (:mod:`dcr.bench.reference`).  Speedup is reference time over refit
latency.  **V_payload** counts each payload of the transition once (the owners' sent bytes),
**V_cross** the bytes that crossed the boundary: what the relay root received, or what every
rollout node fetched from object storage (paper §7.1).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

from dcr.bench.window import refit_timings
from dcr.errors import ConfigError
from dcr.tensors.parallel import default_threads

__all__ = [
    "BACKENDS",
    "TRANSPORTS",
    "BenchLayout",
    "fleet_text",
    "format_refit_table",
    "plot_refit",
    "run_refit_bench",
]

TRANSPORTS = ("relay", "s3", "directory")
BACKENDS = ("process", "ray")
GB = 1e9


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchLayout:
    """Where the roles of the benchmark fleet sit (sized for a machine of 24 GiB: the
    trainer holds about three copies of its shards, every receiver its rank's part)."""

    tp: int = 4
    """Training tensor parallelism (one owner process per rank)."""
    dp: int = 1
    nodes: int = 2
    """Rollout nodes, each hosting one receiver process (one node = one fetcher on object
    storage, one relay node on the relay tree)."""
    serving_tp: int = 2
    """Serving TP of the engines; node ``i`` hosts rank ``i % serving_tp``."""
    chunk_mb: float = 16.0
    bucket_mb: float = 32.0
    """Chunk and bucket targets (paper App. C); the 32 MB bucket gives each owner about as
    many payloads per refit as the paper's 512 MiB buckets give its owners at 120B."""
    build_threads: int = 0
    """Construction threads per owner process (``[trainer] build_threads``); 0: the CPUs
    each owner process may run on (all of this machine's)."""

    def __post_init__(self) -> None:
        if min(self.tp, self.dp, self.nodes, self.serving_tp) < 1:
            raise ConfigError("every layout count must be at least 1")
        if self.nodes % self.serving_tp:
            raise ConfigError(
                f"{self.nodes} nodes do not hold whole engines of serving TP {self.serving_tp}"
            )

    @property
    def owners(self) -> int:
        return self.tp * self.dp

    def describe(self) -> str:
        return (
            f"trainer TP={self.tp} x DP={self.dp} ({self.owners} owner processes, gloo); "
            f"{self.nodes} rollout nodes, one receiver process each (serving TP "
            f"{self.serving_tp}, {self.nodes // self.serving_tp} engine(s)); chunk "
            f"{self.chunk_mb:g} MB, bucket {self.bucket_mb:g} MB, "
            f"{self.build_threads or default_threads()} construction thread(s) per owner"
        )


def schedule(rates: Sequence[float], repeats: int) -> list[float]:
    """The trainer's per-step rates: a warm-up refit at the middle rate, then ``repeats``
    rounds of ``rates``."""
    if not rates or repeats < 1:
        raise ConfigError("give at least one rate and one repeat")
    return [rates[len(rates) // 2], *(list(rates) * repeats)]


def fleet_text(
    *,
    transport: str,
    size_bytes: float,
    steps: Sequence[float],
    layout: BenchLayout,
    link_gbps: float,
    transport_extra: str = "",
    model_dims: Mapping[str, int] | None = None,
    keys: bool = False,
    backend: str = "process",
) -> str:
    """The benchmark's fleet file for one transport (on Ray: one coordinator, as the process
    fleet runs); ``model_dims`` replaces the model of
    ``dcr bench construct`` (tests run a tiny one); ``keys``: the fleet's key directory
    ``keys`` beside it (CURVE on every socket, sealed payloads)."""
    from dcr.bench.construct import synthetic_config

    size_mb = size_bytes / 1e6 if model_dims is None else 0.0
    if model_dims is None:
        cfg = synthetic_config(int(size_bytes))
        dims = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim")  # fmt: skip
        model_dims = {k: int(cfg[k]) for k in dims}
    overrides = "".join(f"{k} = {v}\n" for k, v in model_dims.items())
    # A loaded 2-core machine can keep a process off the CPU for seconds: relay peers are
    # given 10 s of silence (3 s by default) before a send fails as lost.
    relay = 'kind = "relay"\nfanout = 2\npeer_timeout_s = 10.0\n'
    kind = {"relay": relay, "directory": 'kind = "directory"\n',
            "s3": 'kind = "s3"\n'}[transport]  # fmt: skip
    nodes = "".join(
        f'[[rollout]]\nname = "node{i}"\nreceivers = [{{ name = "r{i}", '
        f"tp = {layout.serving_tp}, rank = {i % layout.serving_tp} }}]\n\n"
        for i in range(layout.nodes)
    )
    ray = '[ray]\nnamespace = "dcr-bench"\ncoordinators = 1\n' if backend == "ray" else ""
    return f"""# dcr bench refit: {transport}
[fleet]
name = "bench-refit-{transport}"
run_dir = "run"
{'keys = "keys"' if keys else ""}

[model]
family = "llama"
size_mb = {size_mb}
seed = 0
rates = [{", ".join(repr(r) for r in steps)}]
refits = {len(steps)}
preloaded = true

[model.overrides]
{overrides}
[trainer]
tp = {layout.tp}
dp = {layout.dp}
chunk_mb = {layout.chunk_mb}
bucket_mb = {layout.bucket_mb}
build_threads = {layout.build_threads}
sends_in_flight = 4
timeout_s = 600
lockstep = true

[coordinator]
standbys = 0
join_wait_s = 600
{ray}
[transport]
{kind}link_gbps = {link_gbps}
{transport_extra}
{nodes}"""


# -- the run --------------------------------------------------------------------------------------


@contextlib.contextmanager
def _environ(extra: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _read_events(directory: Path) -> list[dict[str, Any]]:
    from dcr.fleet.eventlog import EventReader

    return list(EventReader(directory).poll())


def _relay_reported(directory: Path, owners: Iterable[str], timeout_s: float = 10.0) -> None:
    """Wait until the relay root reported the traffic (V_cross) of every payload an owner
    sent, before the fleet stops: the root reports its running totals per attempt on its next
    tick (every 0.25 s), so a stop right after the last commit would otherwise lose the last
    refit's figure, or the part of it that came after a tick.  Bounded: a report still short
    then leaves ``cross_bytes`` short (or unknown, ``None``)."""
    owners = frozenset(owners)
    deadline = time.monotonic() + timeout_s
    while True:
        events = _read_events(directory)
        sent: dict[int, int] = {}
        for e in events:
            if e.get("event") == "sent" and e.get("who") in owners:
                sent[int(e["attempt"])] = sent.get(int(e["attempt"]), 0) + int(e["size"])
        seen: dict[int, int] = {}
        for e in events:
            if e.get("event") == "traffic" and str(e.get("who", "")).startswith("relay-"):
                for a, (_cross, payload) in e["attempts"].items():
                    seen[int(a)] = max(seen.get(int(a), 0), int(payload))
        if all(seen.get(a, -1) >= size for a, size in sent.items()):
            return
        if time.monotonic() > deadline:
            return
        time.sleep(0.1)


def _reference_floor(kind: str, checkpoint: int, layout: BenchLayout, link_gbps: float) -> float:
    """The reference's link time alone: the root's link carries the checkpoint once (relay);
    each owner uploads its share, then each node downloads all of it (object storage)."""
    rate = link_gbps * GB / 8
    if kind == "relay":
        return checkpoint / rate
    return checkpoint / layout.owners / rate + checkpoint / rate


def _run_transport(
    kind: str,
    *,
    directory: Path,
    size_bytes: float,
    rates: Sequence[float],
    repeats: int,
    layout: BenchLayout,
    link_gbps: float,
    model_dims: Mapping[str, int] | None,
    log: Callable[[str], None],
    keys: bool = False,
    backend: str = "process",
) -> dict[str, Any]:
    from dcr.adapters.s3server import SeaweedServer
    from dcr.adapters.security import KeyDir
    from dcr.bench.reference import reference_identities, run_reference
    from dcr.fleet.config import load_fleet
    from dcr.fleet.launcher import Launcher

    steps = schedule(rates, repeats)
    with contextlib.ExitStack() as stack:
        extra = ""
        # The role processes set their own allocator parameters (dcr.alloc).
        env: dict[str, str] = {}
        if kind == "s3":
            server = stack.enter_context(SeaweedServer())
            bucket = server.endpoint.create_bucket()
            extra = (
                f'bucket = "{bucket}"\nprefix = "bench-{uuid.uuid4().hex[:8]}"\n'
                f'endpoint_url = "{server.endpoint.url}"\naddressing_style = "path"\n'
            )
            env.update(server.endpoint.environ())
            log(f"s3: SeaweedFS at {server.endpoint.url}, bucket {bucket}")
        stack.enter_context(_environ(env))
        label = kind if backend == "process" else f"{kind}@{backend}"
        path = directory / label / "fleet.toml"
        path.parent.mkdir(parents=True, exist_ok=True)
        text = fleet_text(transport=kind, size_bytes=size_bytes, steps=steps, layout=layout,
                          link_gbps=link_gbps, transport_extra=extra,
                          model_dims=model_dims, keys=keys, backend=backend)  # fmt: skip
        path.write_text(text)
        cfg = load_fleet(path)
        if cfg.keys is not None:
            cfg.ensure_keys()
            KeyDir(cfg.keys).add(reference_identities(cfg))

        def say(line: str) -> None:
            log(f"{label}: {line}")

        t = time.monotonic()
        with contextlib.ExitStack() as cluster:
            ray_start_s = None
            if backend == "ray":
                from dcr.ray.cluster import ClusterShape, local_cluster
                from dcr.ray.run import RayRun

                shape = ClusterShape(trainer_cpus=cfg.world_size, rollout_nodes=len(cfg.rollout))
                cluster.enter_context(local_cluster(shape, say=say))
                ray_start_s = time.monotonic() - t
                say(f"Ray cluster of {2 + shape.rollout_nodes} nodes started in "
                    f"{ray_start_s:.1f} s")  # fmt: skip
                runner: Launcher | RayRun = RayRun(cfg, say=say, deadline_s=3600.0)
            else:
                runner = Launcher(cfg, say=say, deadline_s=3600.0)
            checkpoint = runner.model.checkpoint_bytes
            say(f"fleet of {checkpoint / GB:.2f} GB, {len(steps)} refits "
                f"(warm-up at {steps[0]:.0%}), link {link_gbps:g} Gbit/s")  # fmt: skip
            t = time.monotonic()
            settle = (
                partial(_relay_reported, cfg.events_dir, cfg.owners) if kind == "relay" else None
            )
            report = runner.run(before_stop=settle)
        say(f"fleet done in {time.monotonic() - t:.0f} s, bit-exact: {report['bit_exact']}")
        timings = refit_timings(_read_events(cfg.events_dir), owners=cfg.owners,
                                relayed=kind == "relay")  # fmt: skip
        exact = {r["version"]: r["bit_exact"] for r in report["refits"]}
        for row in timings:
            row["rate"] = steps[row["version"] - 1]
            row["warmup"] = row["version"] == 1
            row["bit_exact"] = exact.get(row["version"], False)
        references = []
        for i in range(repeats):
            ref = run_reference(cfg, checkpoint_bytes=checkpoint,
                                say=lambda line: log(f"{kind}: {line}"))  # fmt: skip
            log(f"{kind}: reference {i + 1}/{repeats}: {ref.seconds:.1f} s")
            references.append(ref)
    return {
        "transport": kind,
        "backend": backend,
        "label": label,
        "ray_start_s": ray_start_s,
        "checkpoint_bytes": checkpoint,
        "report": report,
        "refits": timings,
        "reference": [asdict(r) for r in references],
        "reference_floor_s": _reference_floor(kind, checkpoint, layout, link_gbps),
    }


def _median(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _rows(run: dict[str, Any], rates: Sequence[float], cpus: int) -> list[dict[str, Any]]:
    ref = statistics.median(r["seconds"] for r in run["reference"])
    out = []
    for rate in rates:
        timed = [r for r in run["refits"] if not r["warmup"] and r["rate"] == rate]
        if not timed:
            continue
        latency = _median(r["latency_s"] for r in timed)
        c = _median(r["construction_bound_s"] for r in timed)
        t = _median(r["transport_bound_s"] for r in timed)
        assert latency is not None and c is not None and t is not None
        phases = {k: _median(r["phases"][k] for r in timed) for k in timed[0]["phases"]}
        roles = sorted({k for r in timed for k in r["cpu_s"]})
        cpu = {k: _median(r["cpu_s"].get(k, 0.0) for r in timed) for k in roles}
        out.append(
            {
                "transport": run["transport"],
                "backend": run["backend"],
                "ray_start_s": run["ray_start_s"],
                "rate": rate,
                "model_bytes": run["checkpoint_bytes"],
                "latency_s": latency,
                "reference_s": ref,
                "speedup": ref / latency,
                "payload_bytes": _median(r["payload_bytes"] for r in timed),
                "cross_bytes": _median(r["cross_bytes"] for r in timed),
                "construction_bound_s": c,
                "transport_bound_s": t,
                "bound_ratio": latency / max(c, t) if max(c, t) > 0 else None,
                "reference_floor_s": run["reference_floor_s"],
                "reference_upload_s": _median(r["upload_s"] for r in run["reference"]),
                "reference_download_s": _median(r["download_s"] for r in run["reference"]),
                "phases": phases,
                "cpu_s": cpu,
                "cpu_share": sum(v for v in cpu.values() if v is not None) / latency / cpus,
                # Every role shares this machine's CPUs: the window lasts at least the CPU
                # seconds used in it spread over all of them.
                "cpu_bound_s": sum(v for v in cpu.values() if v is not None) / cpus,
                "attempts": max(r["attempts"] for r in timed),
                "repeats": len(timed),
                "bit_exact": all(r["bit_exact"] for r in timed),
            }
        )
    return out


def run_refit_bench(
    *,
    size_bytes: float = 2e9,
    rates: Sequence[float] = (0.01, 0.03, 0.05),
    transports: Sequence[str] = TRANSPORTS,
    repeats: int = 1,
    link_gbps: float = 1.0,
    layout: BenchLayout | None = None,
    directory: Path = Path("out/bench-refit"),
    model_dims: Mapping[str, int] | None = None,
    log: Callable[[str], None] = lambda line: None,
    keys: bool = False,
    backends: Sequence[str] = ("process",),
) -> dict[str, Any]:
    """Run the benchmark; returns ``{"layout", "link_gbps", "keys", "results": [...],
    "refits", "bit_exact"}`` with one result per (backend, transport, rate).  ``model_dims``:
    HF config fields of another model than ``dcr bench construct``'s (``size_bytes`` is then
    ignored); ``keys``: the fleets run with keys (CURVE on every socket, sealed payloads);
    ``backends``: ``process`` (the fleet launcher) and/or ``ray`` (a local Ray cluster of the
    head, a trainer node and one node per rollout node, :mod:`dcr.ray.cluster`; the same
    fleet as actors, :class:`~dcr.ray.run.RayRun`), each run in turn."""
    layout = layout or BenchLayout()
    bad = [t for t in transports if t not in TRANSPORTS]
    if bad or not transports:
        raise ConfigError(f"transports are {', '.join(TRANSPORTS)}, got {list(transports)}")
    if link_gbps <= 0:
        raise ConfigError("the benchmark needs a link rate (--link-gbps > 0)")
    bad = [b for b in backends if b not in BACKENDS]
    if bad or not backends:
        raise ConfigError(f"backends are {', '.join(BACKENDS)}, got {list(backends)}")
    runs = [
        _run_transport(kind, directory=directory, size_bytes=size_bytes, rates=rates,
                       repeats=repeats, layout=layout, link_gbps=link_gbps,
                       model_dims=model_dims, log=log, keys=keys, backend=backend)
        for backend in backends
        for kind in transports
    ]  # fmt: skip
    cpus = default_threads()  # the CPUs the fleet's processes may run on
    results = [row for run in runs for row in _rows(run, rates, cpus)]
    return {
        "layout": asdict(layout),
        "layout_text": layout.describe(),
        "link_gbps": link_gbps,
        "keys": keys,
        "cpus": cpus,
        "results": results,
        "backends": list(backends),
        "refits": {run["label"]: run["refits"] for run in runs},
        "references": {run["label"]: run["reference"] for run in runs},
        "bit_exact": all(run["report"]["bit_exact"] for run in runs),
    }


# -- output ---------------------------------------------------------------------------------------


def format_refit_table(result: dict[str, Any]) -> str:
    """The fixed-width table of :func:`run_refit_bench`'s results."""
    head = (
        f"{'transport':<13} {'rate':>5} {'latency':>8} {'reference':>9} {'speedup':>7} "
        f"{'V_payload':>11} {'V_cross':>9} {'constr.':>8} {'transp.':>8} {'lat/max':>7} "
        f"{'exact':>5}"
    )
    lines = [
        f"model {result['results'][0]['model_bytes'] / GB:.2f} GB bf16 | "
        f"{result['layout_text']} | link {result['link_gbps']:g} Gbit/s per process and "
        f"direction"
        if result["results"]
        else "no results",
        head,
    ]
    for r in result["results"]:
        share = r["payload_bytes"] / r["model_bytes"]
        cross = "-" if r["cross_bytes"] is None else f"{r['cross_bytes'] / 1e6:.1f}MB"
        ratio = "-" if r["bound_ratio"] is None else f"{r['bound_ratio']:.2f}"
        lines.append(
            f"{_label(r):<13} {r['rate']:>5.0%} {r['latency_s']:>7.2f}s "
            f"{r['reference_s']:>8.1f}s {r['speedup']:>6.1f}x "
            f"{r['payload_bytes'] / 1e6:>6.1f}MB/{share:.1%} {cross:>9} "
            f"{r['construction_bound_s']:>7.2f}s {r['transport_bound_s']:>7.2f}s {ratio:>7} "
            f"{'yes' if r['bit_exact'] else 'NO':>5}"
        )
    lines.append(
        "phases (s): stage / admit / stream / finalize | CPU s in the window: owners / "
        f"receivers / relay / coordinator, share of {result['cpus']} CPUs, CPU bound (their "
        "sum over the CPUs)"
    )
    for r in result["results"]:
        p, c = r["phases"], r["cpu_s"]
        cpu = " / ".join(f"{c.get(k, 0.0):.2f}" for k in ("owners", "receivers", "relay",
                                                           "coordinator"))  # fmt: skip
        lines.append(
            f"  {_label(r):<13} {r['rate']:>4.0%}  {p['stage_s']:.2f} / "
            f"{p['admit_s']:.2f} / {p['stream_s']:.2f} / {p['finalize_s']:.2f} | {cpu}, "
            f"{r['cpu_share']:.0%}, {r['cpu_bound_s']:.2f}s"
        )
    starts = {_label(r): r["ray_start_s"] for r in result["results"] if r["ray_start_s"]}
    for label, seconds in starts.items():
        lines.append(f"{label}: the Ray cluster started in {seconds:.1f} s")
    return "\n".join(lines)


def _label(row: dict[str, Any]) -> str:
    """A result's transport, with its backend when that is not the process fleet."""
    backend = row.get("backend", "process")
    return row["transport"] if backend == "process" else f"{row['transport']}@{backend}"


def plot_refit(result: dict[str, Any], path: Path) -> None:
    """A PNG of latency, reference and both lower bounds per transport and rate."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ConfigError("--plot needs matplotlib: pip install matplotlib") from exc
    kinds = list(dict.fromkeys(_label(r) for r in result["results"]))
    fig, axes = plt.subplots(1, len(kinds), figsize=(4.2 * len(kinds), 4.0), sharey=True,
                             squeeze=False)  # fmt: skip
    series = (
        ("latency_s", "refit latency", "#1f77b4"),
        ("construction_bound_s", "construction bound", "#2ca02c"),
        ("transport_bound_s", "transport bound", "#ff7f0e"),
    )
    for ax, kind in zip(axes[0], kinds, strict=True):
        rows = [r for r in result["results"] if _label(r) == kind]
        xs = range(len(rows))
        width = 0.8 / len(series)
        for i, (key, label, color) in enumerate(series):
            ax.bar([x + (i - 1) * width for x in xs], [r[key] for r in rows], width,
                   label=label, color=color)  # fmt: skip
        ax.axhline(rows[0]["reference_s"], color="#d62728", linestyle="--", label="reference")
        for x, r in zip(xs, rows, strict=True):  # above the latency bar
            ax.annotate(f"{r['speedup']:.0f}x", (x - width, r["latency_s"]), ha="center",
                        va="bottom", fontsize=8)  # fmt: skip
        ax.set_xticks(list(xs), [f"{r['rate']:.0%}" for r in rows])
        ax.set_yscale("log")
        ax.set_title(kind)
        ax.set_xlabel("element change rate")
    axes[0][0].set_ylabel("seconds")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8)
    size = result["results"][0]["model_bytes"] / GB
    fig.suptitle(f"dcr bench refit: {size:.2f} GB bf16, link {result['link_gbps']:g} Gbit/s "
                 "(speedup over the reference above each bar)", fontsize=10)  # fmt: skip
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
