"""The `dcr` command: JSON shapes of the benchmarks and the demo's bit-exactness verdict."""

from __future__ import annotations

import json

import pytest

from dcr import cli


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert cli.main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_bench_codec_json(capsys):
    out = run_json(capsys, "bench", "codec", "--n", "200000")
    rows = out["results"]
    assert [r["a"] for r in rows] == [0.0001, 0.001, 0.01]
    for r in rows:
        assert {"a", "changed", "overwrite_bytes", "xor_bytes", "xor_byteplane_bytes"} <= set(r)
        assert 0 < r["xor_byteplane_bytes"] < r["xor_bytes"] < r["overwrite_bytes"]
    assert rows[0]["changed"] < rows[1]["changed"] < rows[2]["changed"]


def test_bench_construct_json(capsys):
    out = run_json(
        capsys, "bench", "construct", "--size-gb", "0.02", "--rates", "0.03", "--repeats", "1"
    )
    rows = {r["mode"]: r for r in out["results"]}
    assert set(rows) == {"X", "P", "F"}
    for r in rows.values():
        for key in (
            "rate",
            "changed_elements",
            "payload_bytes",
            "construct_seconds",
            "source_bytes",
            "bandwidth_reference_gb_per_s",
        ):
            assert key in r
        assert r["rate"] == 0.03
    # same changes found by every mode; XOR masks compress better than overwrite values
    assert rows["X"]["changed_elements"] == rows["P"]["changed_elements"] > 0
    assert rows["X"]["payload_bytes"] < rows["P"]["payload_bytes"]
    assert rows["X"]["bytes_per_changed_element"] < 1.6


def test_bad_arguments_exit_with_usage(capsys):
    with pytest.raises(SystemExit) as err:
        cli.main(["bench", "construct", "--modes", "X,Q"])
    assert err.value.code == 2
    assert "modes are X, P and F" in capsys.readouterr().err


def test_demo_is_bit_exact(capsys):
    out = run_json(capsys, "demo", "--size-mb", "8", "--refits", "2")
    assert out["bit_exact"] is True
    assert [r["version"] for r in out["refits"]] == [1, 2]
    assert all(r["bit_exact"] and r["changed_elements"] > 0 for r in out["refits"])
    assert out["owners"] == 4 and out["receiver_ranks"] == 3


def test_demo_exits_nonzero_when_a_receiver_misses_a_payload(capsys, monkeypatch):
    """A receiver engine that silently skips its first payload yet acknowledges: the demo's
    dense check must catch it and the command must fail."""
    from dcr.engine.receiver import ReceiverService

    real = ReceiverService._apply_group
    skipped: list[object] = []

    def skip_first(self, attempt, keys):
        if not skipped and self.name == "r0":
            skipped.append(keys[0])
            self._decoded.pop(keys[0])
            keys = keys[1:]
        return real(self, attempt, keys)

    monkeypatch.setattr(ReceiverService, "_apply_group", skip_first)
    assert cli.main(["demo", "--size-mb", "8", "--refits", "1", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["bit_exact"] is False and skipped


def test_demo_with_faults_recovers_bit_exactly(capsys):
    out = run_json(capsys, "demo", "--size-mb", "8", "--refits", "5", "--faults")
    assert out["bit_exact"] is True
    rows = out["refits"]
    assert rows[0]["attempts"] == ["mixed"]
    # refit 2: a receiver killed mid-refit -> overwrite retry, restarted by dense refit
    assert rows[1]["attempts"] == ["mixed", "overwrite"]
    assert rows[1]["faults"]["killed"] == ["r1"] and rows[1]["faults"]["restarted"] == ["r1"]
    # refit 3: damaged deliveries fail the mixed attempt; the retry repairs
    assert rows[2]["attempts"] == ["mixed", "overwrite"] and rows[2]["faults"]["dropped"] == 1
    # refit 4: a lost commit reply is resolved by read_commit, no retry needed
    assert rows[3]["attempts"] == ["mixed"] and rows[3]["faults"]["lost_commit_replies"] == 1
    # refit 5: failover; the new coordinator retries in overwrite mode
    assert rows[4]["faults"]["failovers"] == 1 and rows[4]["attempts"][-1] == "overwrite"
