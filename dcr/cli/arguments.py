"""Argument types and output helpers shared by the ``dcr`` subcommands: comma-separated
numbers, benchmark workloads, construction modes, loader and transport names, positive
integers, progress on stderr."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dcr.bench.workloads import Workload


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {text!r}"
        ) from None


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {text!r}")
    return value


def _workloads(text: str) -> list[Workload]:
    """``--rates`` of the construct and apply benchmarks: comma-separated change rates in
    (0, 1] and ``adamw:LR`` tokens (:func:`dcr.bench.workloads.parse_workloads`)."""
    from dcr.bench.workloads import parse_workloads

    try:
        return parse_workloads(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _modes(text: str) -> list[str]:
    modes = [m.strip().upper() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in ("X", "P", "F")]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"modes are X, P and F, got {text!r}")
    return modes


def _loaders(text: str) -> list[str]:
    from dcr.bench.apply import LOADERS

    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in LOADERS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"loaders are {', '.join(LOADERS)}, got {text!r}")
    return names


def _transports(text: str) -> list[str]:
    from dcr.bench.refit import TRANSPORTS

    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in TRANSPORTS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"transports are {', '.join(TRANSPORTS)}, got {text!r}")
    return names


def _backends(text: str) -> list[str]:
    from dcr.bench.refit import BACKENDS

    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in BACKENDS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"backends are {', '.join(BACKENDS)}, got {text!r}")
    return names


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _fp8_block(text: str) -> int | None:
    """An FP8 scale tile size (a positive int), or ``channel`` (``None``)."""
    if text.strip().lower() == "channel":
        return None
    return _positive(text)


def _fp8_blocks(text: str) -> list[int | None]:
    out = [_fp8_block(t) for t in text.split(",") if t.strip()]
    if not out:
        raise argparse.ArgumentTypeError(f"expected tile sizes or 'channel', got {text!r}")
    return out


def _err(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Whatever is written to standard output inside goes to standard error instead: by
    Python code (Ray's driver prints its raylets' error messages there, "A worker died ...",
    when an actor is killed) and by the processes started inside (which inherit file
    descriptor 1).  A command's ``--json`` output, printed afterwards, is the only thing on
    its standard output."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 1)
        os.close(saved)
