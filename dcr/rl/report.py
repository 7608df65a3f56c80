"""What ``dcr rl`` reports: the per-step rows of a run from rank 0's events, the live line of
each step, the comparison of two runs and the table."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["COMPARED", "compare_runs", "format_rl_table"]


class _Steps:
    """The per-step rows of a run, from rank 0's events (``rl-step``, ``rl-refit``), and the
    live line of each step."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self.say = say
        self.steps: dict[int, dict[str, Any]] = {}
        self.refits: dict[int, dict[str, Any]] = {}
        self.replayed: set[int] = set()
        self.done = False

    def on_event(self, e: dict[str, Any]) -> None:
        kind = e.get("event")
        if kind == "rl-step":
            self.steps[int(e["step"])] = e
        elif kind == "rl-refit":
            step = int(e["step"])
            self.refits[step] = e
            self.say(_line(self.row(step)))
        elif kind == "rl-done":
            self.done = True
        elif kind == "rl-waiting":
            self.say(f"  {e['message']}")
        elif kind == "rl-resumed":
            self.say(f"  trainer resumed at version {e['version']} (saved state {e['saved']})")
        elif kind == "rl-replayed":
            self.replayed.add(int(e["step"]))
            self.say(f"  trainer replayed step {e['step']} from its stored rollouts")

    def row(self, step: int) -> dict[str, Any]:
        s, r = self.steps.get(step, {}), self.refits.get(step, {})
        return {
            "step": step,
            "version": step,
            "reward": s.get("reward"),
            "kl": s.get("kl"),
            "loss": s.get("loss"),
            "tokens_sha256": s.get("tokens_sha256"),
            "refit_s": r.get("refit_s"),
            "gate_closed_s": r.get("gate_closed_s"),
            "dense_refit_s": r.get("dense_refit_s"),
            "payload_bytes": r.get("payload_bytes"),
            "changed_elements": r.get("changed_elements"),
            "staleness": s.get("staleness"),
            "replayed": step in self.replayed,
        }

    def rows(self, steps: int) -> list[dict[str, Any]]:
        return [self.row(k) for k in range(1, steps + 1)]


def _num(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _line(row: dict[str, Any]) -> str:
    return (
        f"step {row['step']:>3}  reward {_num(row['reward'], '.4f')}  kl {_num(row['kl'], '.2e')}"
        f"  loss {_num(row['loss'], '+.4f')}  refit {_num(row['refit_s'], '.3f')} s"
        f"  gate {_num(row['gate_closed_s'], '.3f')} s  {_num(row['payload_bytes'], ',')} B"
        f"  changed {_num(row['changed_elements'], ',')}  staleness {_num(row['staleness'], 'd')}"
        f"  tokens {str(row['tokens_sha256'])[:12]}"
    )


COMPARED = ("reward", "kl", "loss", "tokens_sha256")
"""What two runs of the same seed must agree on at every step (and the final weights)."""


def compare_runs(result: dict[str, Any], against: dict[str, Any]) -> dict[str, Any]:
    """Whether ``result`` and ``against`` (a dense run, say) agree: every step's reward, KL,
    loss and token digest, and the final weights' digest."""
    theirs = {r["step"]: r for r in against["steps"]}
    differ = [
        r["step"] for r in result["steps"]
        if any(theirs.get(r["step"], {}).get(k) != r[k] or r[k] is None for k in COMPARED)
    ]  # fmt: skip
    final = result["final_weights_sha256"] == against["final_weights_sha256"]
    # Runs serving different rollouts (BF16, FP8 of other scales) are different runs.
    serving = _serving(result) == _serving(against)
    return {
        "refit": against.get("refit"),
        "steps_compared": len(result["steps"]),
        "steps_differing": differ,
        "final_weights_equal": final,
        "same_rollout_dtype": serving,
        "equal": serving and final and not differ and len(theirs) == len(result["steps"]),
        "refit_s": [theirs.get(r["step"], {}).get("refit_s") for r in result["steps"]],
    }


def _serving(result: dict[str, Any]) -> tuple[str, Any]:
    """What a run's engine served: its rollout dtype and FP8 scale tiles."""
    return str(result.get("rollout_dtype", "bf16")), result.get("fp8_block")


def format_rl_table(result: dict[str, Any], against: dict[str, Any] | None = None) -> str:
    """The per-step table (beside a dense run's refit seconds and agreement when given)."""
    from io import StringIO

    from rich.console import Console
    from rich.table import Table

    dtype, block = _serving(result)
    served = "" if dtype == "bf16" else f", FP8 rollouts ({block} scales)"
    table = Table(title=f"dcr rl: {result['refit']} refits, {result['mode']}, TP {result['tp']}"
                  f"{served}")  # fmt: skip
    for col in ("step", "reward", "KL", "loss", "refit s", "gate s", "payload B", "changed",
                "stale", "tokens"):  # fmt: skip
        table.add_column(col, justify="right")
    if against is not None:
        table.add_column("dense refit s", justify="right")
        table.add_column("= dense", justify="center")
    dense = {r["step"]: r for r in against["steps"]} if against is not None else {}
    for row in result["steps"]:
        cells = [
            str(row["step"]), _num(row["reward"], ".4f"), _num(row["kl"], ".2e"),
            _num(row["loss"], "+.4f"), _num(row["refit_s"], ".3f"),
            _num(row["gate_closed_s"], ".3f"), _num(row["payload_bytes"], ","),
            _num(row["changed_elements"], ","), _num(row["staleness"], "d"),
            str(row["tokens_sha256"])[:10],
        ]  # fmt: skip
        if against is not None:
            d = dense.get(row["step"], {})
            same = all(d.get(k) == row[k] for k in COMPARED)
            cells += [_num(d.get("refit_s"), ".3f"), "✓" if same else "✗"]
        table.add_row(*cells)
    buf = StringIO()
    console = Console(file=buf, width=160)
    console.print(table)
    console.print(f"final weights sha256 {result['final_weights_sha256']}")
    if result["killed"]:
        console.print("killed: " + ", ".join(f"{k['role']} at step {k['step']}"
                                              for k in result["killed"]))  # fmt: skip
    if against is not None:
        same = result["final_weights_sha256"] == against["final_weights_sha256"]
        console.print(f"final weights equal the dense run's: {'✓' if same else '✗'}")
    return buf.getvalue()
