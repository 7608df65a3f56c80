"""The `dcr` command: JSON shapes of the benchmarks and the demo's bit-exactness verdict."""

from __future__ import annotations

import json

import pytest

from dcr import cli
from dcr.local import LocalRefit


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
    real = LocalRefit.apply_payloads

    def drop_one(self, payloads, *args, **kwargs):
        payloads = list(payloads)
        biggest = max(range(len(payloads)), key=lambda i: len(payloads[i]))
        return real(self, payloads[:biggest] + payloads[biggest + 1 :], *args, **kwargs)

    monkeypatch.setattr(LocalRefit, "apply_payloads", drop_one)
    assert cli.main(["demo", "--size-mb", "8", "--refits", "1", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["bit_exact"] is False
