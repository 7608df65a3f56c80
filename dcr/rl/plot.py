"""``dcr rl --plot``: a run's reward, KL and refit seconds per step as a PNG."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["plot_rl"]


def plot_rl(result: dict[str, Any], path: Path, against: dict[str, Any] | None = None) -> None:
    """Reward, KL and refit seconds per step (beside a dense run's when given) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    runs = [(result, f"{result['refit']} refit")]
    if against is not None:
        runs.append((against, f"{against['refit']} refit"))
    for run, label in runs:
        steps = [r["step"] for r in run["steps"]]
        style = "-o" if run is result else "--s"
        for ax, key in zip(axes, ("reward", "kl", "refit_s"), strict=True):
            ax.plot(steps, [r[key] if r[key] is not None else float("nan") for r in run["steps"]],
                    style, label=label, markersize=3)  # fmt: skip
    for k in result["killed"]:
        for ax in axes:
            ax.axvline(k["step"], color="red", alpha=0.3, linewidth=1)
    axes[0].set_title("mean reward")
    axes[1].set_title("KL to the initial policy (k3)")
    axes[2].set_title("refit seconds (publish -> live in the engine; log)")
    axes[2].set_yscale("log")
    for ax in axes:
        ax.set_xlabel("step")
        ax.legend()
    fig.suptitle(
        f"dcr rl: {result['mode']}, TP {result['tp']}"
        + (f", {len(result['killed'])} SIGKILLs (red)" if result["killed"] else "")
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
