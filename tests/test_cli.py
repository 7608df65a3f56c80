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
            "buffer_copy_gb_per_s",
            "source_copy_gb_per_s",
            "vs_memcpy",
        ):
            assert key in r
        assert r["rate"] == 0.03 and r["workload"] == "3%"
        # some chosen elements keep their bits: fewer change than were chosen
        assert r["changed_elements"] == round(r["changed_fraction"] * r["checkpoint_bytes"] / 2)
        assert 0.02 < r["changed_fraction"] < 0.03
        assert not any(k.startswith(("adaptive_", "dense_")) for k in r)  # no --dense-above
        assert r["vs_memcpy"] > 0
        # one run: its reference is the faster of the buffer copy and the copy of what
        # construction reads
        copies = (r["buffer_copy_gb_per_s"], r["source_copy_gb_per_s"])
        assert min(copies) > 0
        assert r["bandwidth_reference_gb_per_s"] == max(copies)
    # same changes found by every mode; XOR masks compress better than overwrite values
    assert rows["X"]["changed_elements"] == rows["P"]["changed_elements"] > 0
    assert rows["X"]["payload_bytes"] < rows["P"]["payload_bytes"]
    assert rows["X"]["bytes_per_changed_element"] < 1.6


def test_bench_construct_workloads_beside_dense_and_adaptive_builds(capsys):
    from dcr.bench.construct import format_construct_table

    out = run_json(
        capsys, "bench", "construct", "--size-gb", "0.02", "--rates", "0.01,adamw:1e-5",
        "--modes", "X", "--dense-above", "0.1", "--repeats", "1",
    )  # fmt: skip
    one, adamw = out["results"]
    assert out["model"]["dense_above"] == 0.1
    assert (one["workload"], adamw["workload"]) == ("1%", "adamw lr=1e-05")
    assert one["rate"] == 0.01 and "adamw_lr" not in one
    # An AdamW row's rate is its measured fraction: one step at 1e-5 changes the words of
    # the weights whose bf16 spacing is finer than the step (about 15% of N(0, 0.02)).
    assert adamw["adamw_lr"] == 1e-5 and adamw["rate"] == adamw["changed_fraction"]
    assert 0.08 < adamw["changed_fraction"] < 0.3
    for r in (one, adamw):
        words = r["checkpoint_bytes"] / 2
        assert r["changed_elements"] == round(r["changed_fraction"] * words) > 0
        assert r["dense_above"] == 0.1 and r["adaptive_construct_seconds"] > 0
        # the dense build of the model: every element, more bytes than either refit
        assert r["dense_payload_bytes"] > r["adaptive_payload_bytes"]
        assert r["dense_payload_bytes"] > r["payload_bytes"] and r["dense_construct_seconds"] > 0
    assert one["dense_payload_bytes"] == adamw["dense_payload_bytes"]
    # 1% stays sparse; at 15% every weight matrix goes dense (the norms, unchanged, do not)
    assert one["adaptive_dense_tensors"] == 0
    assert one["adaptive_payload_bytes"] == one["payload_bytes"]
    assert adamw["adaptive_dense_tensors"] > 0
    assert adamw["adaptive_dense_elements"] > 0.9 * adamw["checkpoint_bytes"] / 2
    assert adamw["adaptive_payload_bytes"] > adamw["payload_bytes"]  # ULP deltas beat dense
    table = format_construct_table(out)
    assert "adamw lr=1e-05" in table and "adapt MB" in table and "dense MB" in table


def test_bad_arguments_exit_with_usage(capsys):
    with pytest.raises(SystemExit) as err:
        cli.main(["bench", "construct", "--modes", "X,Q"])
    assert err.value.code == 2
    assert "modes are X, P and F" in capsys.readouterr().err


@pytest.mark.parametrize("bench", ["construct", "apply"])
@pytest.mark.parametrize("rates", ["0.01,1.5", "0", "adamw:-1e-5", "adamw:x", "sgd:1e-3"])
def test_bench_rates_outside_the_notation_exit_with_usage(capsys, bench, rates):
    with pytest.raises(SystemExit) as err:
        cli.main(["bench", bench, "--rates", rates])
    assert err.value.code == 2
    assert "expected a change rate in (0, 1] or adamw:LR" in capsys.readouterr().err


def test_bench_rates_parse_to_workloads():
    from dcr.bench.workloads import Workload

    for bench in ("construct", "apply"):
        args = cli._parser().parse_args(["bench", bench, "--rates", "0.001,1.0,adamw:1e-6"])
        assert args.rates == [
            Workload("perturb", 0.001), Workload("perturb", 1.0), Workload("adamw", 1e-6),
        ]  # fmt: skip


def test_every_help_text_renders_its_percent_signs_once():
    """Descriptions are not %-formatted by argparse (only argument help is): a doubled
    percent sign there reaches the user as written."""
    import argparse

    def parsers(p: argparse.ArgumentParser):
        yield p
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    yield from parsers(sub)

    seen = 0
    for p in parsers(cli._parser()):
        text = p.format_help()
        assert "%%" not in text, p.prog
        seen += 1
    assert seen > 10


def test_rl_batch_options_name_the_config_defaults_and_leave_them_unset():
    """``dcr rl --prompts/--group-size``: their help states ``RLConfig``'s defaults (the
    parser does not import the RL package: it imports torch); left out, they stay unset."""
    from dcr.rl.config import RLConfig

    parser = cli._parser()
    args = parser.parse_args(["rl"])
    assert (args.prompts, args.group_size) == (None, None)
    args = parser.parse_args(["rl", "--prompts", "4", "--group-size", "2"])
    assert (args.prompts, args.group_size) == (4, 2)
    (rl,) = [
        a.choices["rl"] for a in parser._actions if isinstance(getattr(a, "choices", None), dict)
    ]
    text = " ".join(rl.format_help().split())
    assert f"prompts per step (default {RLConfig.prompts_per_step})" in text
    assert f"GRPO's group (default {RLConfig.group_size})" in text
    with pytest.raises(SystemExit):
        parser.parse_args(["rl", "--prompts", "0"])


_NOISY = """
import os, subprocess, sys
from dcr.cli.arguments import stdout_to_stderr
with stdout_to_stderr():
    print("python print")
    os.write(1, b"fd write\\n")
    subprocess.run([sys.executable, "-c", "print('child print')"], check=True)
print('{"json": 1}')
"""


def test_a_json_command_prints_only_its_json_on_stdout():
    """What libraries and child processes write to stdout during a ``--json`` run (Ray's
    driver prints raylet messages there) goes to stderr."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _NOISY], capture_output=True, text=True, timeout=120, check=True
    )
    assert json.loads(done.stdout) == {"json": 1}
    assert done.stderr.splitlines() == ["python print", "fd write", "child print"]


def test_demo_runs_a_fleet_of_processes_bit_exactly(capsys, tmp_path):
    out = run_json(
        capsys, "demo", "--size-mb", "0", "--refits", "2", "--rate", "0.05", "--dir",
        str(tmp_path),
    )  # fmt: skip
    assert out["bit_exact"] is True and out["mismatches"] == []
    assert out["processes"] == 11  # 2 relays, coordinator + standby, 3 receivers, 4 owners
    assert [r["version"] for r in out["refits"]] == [1, 2]
    for row in out["refits"]:
        assert set(row) >= {"version", "bit_exact", "payload_bytes", "attempts", "killed",
                            "seconds"}  # fmt: skip
        assert row["bit_exact"] and row["payload_bytes"] > 0 and row["attempts"] == ["mixed"]
        assert row["receivers_checked"] == ["r0", "r1", "r2"] and row["killed"] == []
        # Fault-free: each payload crossed into the relay tree exactly once.
        assert row["v_cross"] == row["v_payload"] == row["payload_bytes"]
    assert (tmp_path / "fleet.toml").exists() and (tmp_path / "run" / "commit.db").exists()


def test_bench_apply_json(capsys):
    from dcr.bench.apply import format_apply_table

    out = run_json(
        capsys, "bench", "apply", "--size-gb", "0.01", "--rates", "0.01,adamw:1e-5",
        "--repeats", "1", "--loaders", "torch,sharded-tp2", "--dense-above", "0.1",
    )  # fmt: skip
    rows = out["results"]
    assert [(r["loader"], r["workload"]) for r in rows] == [
        ("torch", "1%"), ("torch", "adamw lr=1e-05"),
        ("sharded-tp2", "1%"), ("sharded-tp2", "adamw lr=1e-05"),
    ]  # fmt: skip
    for r in rows:
        assert {"rate", "loader", "apply_seconds", "dense_load_seconds", "entries"} <= set(r)
        assert r["apply_seconds"] > 0 and r["dense_load_seconds"] > 0 and r["read_seconds"] > 0
        assert r["bit_exact"] is True
        assert r["dense_above"] == 0.1 and r["adaptive_apply_seconds"] > 0
    # The same seeded versions for every loader; an AdamW row's rate is its measured fraction.
    assert rows[0]["rate"] == 0.01 and 0.005 < rows[0]["changed_fraction"] < 0.01
    # About 1 - (1 - p)^32 of the 64-byte lines hold one of p uniformly changed bf16 words.
    p = rows[0]["changed_fraction"]
    assert 0.8 < rows[0]["lines_fraction"] / (1 - (1 - p) ** 32) < 1.2
    assert rows[1]["changed_fraction"] < rows[1]["lines_fraction"] <= 1.0
    assert rows[1]["rate"] == rows[1]["changed_fraction"] == rows[3]["changed_fraction"]
    assert 0.08 < rows[1]["changed_fraction"] < 0.3 and rows[1]["adamw_lr"] == 1e-5
    assert "adamw lr=1e-05" in format_apply_table(out)
    # At 1% no tensor goes dense; after the AdamW step (about 15% of each weight matrix's words
    # changed) the large ones do (each applied bit-exactly, on the sharded loader through
    # fused and padded parameters too), and their bytes are the dense build's bytes of those
    # tensors.
    for r in rows:
        if r["rate"] == 0.01:
            assert r["dense_payload_bytes"] > r["payload_bytes"]  # every element vs 1%
            assert r["adaptive_dense_items"] == 0
            assert r["adaptive_payload_bytes"] == r["payload_bytes"]
        else:
            assert r["adaptive_dense_items"] > 0
            assert r["adaptive_payload_bytes"] != r["payload_bytes"]
    # Sparse, dense and the adaptive choice side by side: the dense refit sends every changed
    # tensor whole, never more than the model's dense build; the choice follows dense_above.
    for r in rows:
        assert r["dense_apply_seconds"] > 0 and r["dense_ratio"] > 0 and r["dense_items"] > 0
        assert r["payload_bytes"] < r["dense_refit_bytes"] <= r["dense_payload_bytes"] * 1.01
        assert 0 <= r["adaptive_dense_items"] <= r["dense_items"]
        if r["rate"] == 0.01:
            assert r["adaptive_choice"] == "sparse"
            assert r["adaptive_ratio"] == r["ratio"]
        else:
            assert r["adaptive_choice"] in ("dense", "mixed")
    assert set(out["break_even"]) == {"torch", "sharded-tp2"}
    assert out["model"]["dense_above"] == 0.1
    # The calibrated setting is the lowest break-even the run measured (none: sparse won).
    found = [f for f in out["break_even"].values() if f is not None]
    assert out["calibrated_dense_above"] == (round(min(found), 4) if found else None)
    table = format_apply_table(out)
    assert "adaptive" in table and ("dense applies faster" in table or "sparse applies" in table)
    if found:
        assert f"[trainer] dense_above = {out['calibrated_dense_above']}" in table
    # Every entry lands once on the single torch rank; the sharded ranks write no fewer.
    assert rows[0]["written"] == rows[0]["entries"] > 0
    assert rows[1]["entries"] > rows[0]["entries"]
    assert rows[2]["entries"] == rows[0]["entries"] and rows[2]["written"] >= rows[2]["entries"]


def test_bench_apply_fails_loudly_when_the_bits_differ(monkeypatch):
    from dcr.bench import apply as bench

    real = bench._apply

    def lossy(receivers, payloads, attempt):
        dropped = [type(p)(header=p.header, items=p.items[1:]) for p in payloads]
        return real(receivers, dropped, attempt)

    monkeypatch.setattr(bench, "_apply", lossy)
    with pytest.raises(bench.NotBitExact, match="differs from a dense load"):
        bench.run_apply_bench(size_bytes=10_000_000, rates=[0.01], loaders=["torch"], repeats=1)


def test_bench_apply_rejects_unknown_loaders(capsys):
    with pytest.raises(SystemExit) as err:
        cli.main(["bench", "apply", "--loaders", "torch,sglang"])
    assert err.value.code == 2
    assert "loaders are torch, sharded-tp2, vllm" in capsys.readouterr().err


def test_bench_codec_floor_json(capsys):
    out = run_json(capsys, "bench", "codec", "--floor", "--n", "200000")
    rows = out["results"]
    assert {(r["encoding"], r["version"]) for r in rows} >= {("XOR", 1), ("ULP", 2)}
    for r in rows:
        assert r["payload_bytes"] > 0 and r["floor_bytes"] > 0
        assert r["ratio"] == pytest.approx(r["payload_bytes"] / r["floor_bytes"])


def test_bench_proof_json(capsys):
    out = run_json(capsys, "bench", "proof", "--size-mb", "16", "--trials", "2", "--repeats", "1")
    assert out["cost"]["resident_gb"] > 0
    assert out["cost"]["fingerprint_receiver_s_per_gb"] > 0
    # The fingerprint catches every corruption kind in every trial.
    assert all(rates["fingerprint"] == 1.0 for rates in out["detection"].values())


def test_bench_dense_json(capsys):
    out = run_json(
        capsys, "bench", "dense", "--size-gb", "0.01", "--loaders", "torch,sharded-tp2",
        "--bucket-mb", "4",
    )  # fmt: skip
    build = out["build"]
    assert build["payloads"] > 1 and build["payload_bytes"] > 0
    assert build["largest_bucket_bytes"] <= out["model"]["checkpoint_bytes"]
    assert [r["loader"] for r in out["apply"]] == ["torch", "sharded-tp2"]
    for r in out["apply"]:
        assert r["bit_exact"] is True and r["payloads"] == build["payloads"]
        assert r["apply_seconds"] > 0 and r["dense_load_seconds"] > 0


def test_break_even_is_where_sparse_apply_meets_dense():
    from dcr.bench.apply import break_even

    def row(f, sparse, dense):
        return {"changed_fraction": f, "ratio": sparse, "dense_ratio": dense}

    # sparse 0.2 below dense at 4% and 0.2 above at 12%: they meet half way, at 8%
    rows = [row(0.12, 1.15, 0.95), row(0.04, 0.75, 0.95), row(0.01, 0.35, 0.95)]
    assert break_even(rows) == pytest.approx(0.08)
    assert break_even([row(0.01, 0.4, 0.9), row(0.05, 0.8, 0.9)]) is None
    assert break_even([row(0.2, 1.5, 0.9), row(0.5, 3.0, 0.9)]) == 0.2
