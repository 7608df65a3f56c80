"""A fleet of real processes: what travels relative is what the receivers report.

Each sharded rank stores the final norm in float32 (a cast on copy: a transforming loader
path).  The receivers report it in their status (``xor_refused``), the coordinator binds the
union into every mixed-mode prepare, and the owners -- whose integration setup sends nothing
relative on its own -- send the norm as overwrites and every other changed tensor relative;
every receiver ends bit-exact.  The events say so: the receivers' ``started``, the
coordinator's ``transition`` (how many tensors go relative, which are refused by whom) and the
owners' ``built`` (how each bucket's tensors travel).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fleet_helpers import small_fleet

from dcr.fleet.launcher import Launcher
from dcr.fleet.model import FleetModel

NORM = "model.norm.weight"


def _events(run_dir: Path, pattern: str) -> list[dict[str, Any]]:
    return [
        json.loads(line)
        for path in sorted((run_dir / "events").glob(f"{pattern}.jsonl"))
        for line in path.read_text().splitlines()
    ]


def test_the_receivers_refused_sets_decide_what_the_owners_send_relative(tmp_path: Path) -> None:
    cfg = small_fleet(tmp_path, refits=2)
    report = Launcher(cfg, deadline_s=600).run()
    assert report["bit_exact"] is True, report["mismatches"]
    assert [r["version"] for r in report["refits"]] == [1, 2]
    catalog = FleetModel(cfg).catalog
    receivers = [r.name for r in cfg.receivers]

    # Each receiver classified its loader paths at prewarm: the norm is refused.
    for name in receivers:
        [e] = [e for e in _events(cfg.run_dir, name) if e["event"] == "started"]
        assert (e["relative"], e["refused"]) == (len(catalog) - 1, [NORM])

    # The coordinator bound the union of the members' reports: one refused name, by all.
    coordinator = _events(cfg.run_dir, "coordinator*")
    transitions = [e for e in coordinator if e["event"] == "transition"]
    assert len(transitions) == 2
    for e in transitions:
        assert e["required"] == receivers
        assert e["relative"] == len(catalog) - 1
        assert (e["refused_count"], e["refused"]) == (1, {NORM: receivers})
        assert e["unreported"] == []
    attempts = [a for e in coordinator if e["event"] == "ended" for a in e["attempts"]]
    assert [(a["mode"], a["refused"]) for a in attempts] == [("mixed", 1), ("mixed", 1)]

    # The owners sent exactly the refused name as overwrites, the others relative.
    mixed = {a["attempt"] for a in attempts}
    built = [
        e for e in _events(cfg.run_dir, "o*")
        if e["event"] == "built" and e["attempt"] in mixed and "relative" in e
    ]  # fmt: skip
    assert {e["attempt"] for e in built} == mixed
    overwritten = {n for e in built for n in e["overwrite_names"]}
    assert overwritten == {NORM}  # the step changed the norm, and nothing else went this way
    assert all(e["overwrite"] == len(e["overwrite_names"]) for e in built)
    assert sum(e["relative"] for e in built) >= len(catalog) - 1
