"""FP8 refits through vLLM's real FP8 model classes and native loader on CPU.

The rollout checkpoint is ``dcr fp8 export`` of each BF16 version.  With per-output-channel
scales it is compressed-tensors' FP8 format (float8 weights, per-channel float32 scales,
dynamic per-token FP8 activations), which vLLM's CPU build loads into fused float8 parameters
(``qkv_proj``, ``gate_up_proj``, the experts' ``w13_weight``/``w2_weight``) and fused scales.
Each test applies the FP8 refit of the owners (:class:`~dcr.delta.fp8.Fp8Rollout`) through an
:class:`~dcr.apply.applier.Applier` on that model and compares every parameter and buffer bit
for bit with vLLM's own fresh load of the next export.  vLLM's block-scale format needs AMX
on CPU: where the build refuses it, the refusal is a clear :class:`LoaderPathUnsupported`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from vllm_helpers import bit_mismatches

from dcr.adapters.loaders.vllm import VllmLoader
from dcr.apply.applier import Applier
from dcr.delta.fp8 import Fp8Rollout, Fp8Stats
from dcr.errors import LoaderPathUnsupported
from dcr.models.families import random_state_dict, tiny_config
from dcr.models.fp8 import export_checkpoint, quantized_names
from dcr.models.hf import read_checkpoint, write_checkpoint
from dcr.models.updates import adamw_update, perturb
from dcr.tensors.fp8 import FP8_DTYPE, Fp8Scheme
from dcr.tensors.records import TensorSpec
from dcr.testing.fp8 import grow_first_row_max, refit_items

pytestmark = pytest.mark.vllm

Build = Callable[[Path], torch.nn.Module]
FAMILY_OVERRIDES: dict[str, dict[str, Any]] = {
    "qwen3": {"max_position_embeddings": 16384},
    "qwen3_moe": {"max_position_embeddings": 16384},
    "llama": {"head_dim": 32, "max_position_embeddings": 16384},
}
"""As the engine tests' models: CPU attention needs head_dim >= 32, the fixed prompts reach 270
tokens."""


def _versions(family: str, tmp: Path, scheme: Fp8Scheme, count: int = 3) -> list[dict[str, Any]]:
    """BF16 versions (3% perturbed with moved scales, then a real AdamW step) and their FP8
    exports."""
    cfg = tiny_config(family, **FAMILY_OVERRIDES[family])
    sds = [random_state_dict(cfg, family, seed=11)]
    sds.append(perturb(sds[0], rate=0.03, seed=12))
    grow_first_row_max(sds[1])
    sds.append(adamw_update(sds[1], lr=1e-4, seed=13))
    out = []
    for v, sd in enumerate(sds[:count]):
        src = write_checkpoint(tmp / f"bf16-v{v}", cfg, family, sd)
        path = tmp / f"fp8-v{v}"
        export_checkpoint(src, path, scheme)
        out.append({"bf16": sd, "path": path, "fp8": read_checkpoint(path)})
    return out


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "llama"])
def test_channel_scaled_fp8_refits_equal_vllms_fresh_loads(
    family: str, tmp_path: Path, build_model: Build
) -> None:
    scheme = Fp8Scheme(None)
    versions = _versions(family, tmp_path, scheme)
    model = build_model(versions[0]["path"])
    fp8_params = {n for n, p in model.named_parameters() if p.dtype == FP8_DTYPE}
    assert any("qkv_proj" in n for n in fp8_params)
    if family == "qwen3_moe":
        assert any("w13_weight" in n for n in fp8_params)
    receiver = Applier(VllmLoader(model),
                       {n: TensorSpec.of(n, t) for n, t in versions[0]["fp8"].items()})  # fmt: skip
    receiver.prewarm()
    bf16 = versions[0]["bf16"]
    names = quantized_names({n: tuple(t.shape) for n, t in bf16.items()})
    rollout = Fp8Rollout(scheme, {n: bf16[n] for n in names})
    for v in range(1, len(versions)):
        reference = build_model(versions[v]["path"])
        assert bit_mismatches(model, reference), "the versions must differ"
        stats = Fp8Stats()
        items = refit_items(versions[v - 1]["bf16"], versions[v]["bf16"], rollout, stats)
        assert stats.fp8_changed > 0
        assert stats.scales_changed > 0 or v != 1  # v1 moved every first row's scale
        receiver.apply_items(items, attempt=v)
        rollout.commit()
        assert bit_mismatches(model, reference) == []


def test_block_scaled_fp8_refits_or_a_clear_refusal(tmp_path: Path, build_model: Build) -> None:
    """vLLM's ``fp8`` block format: its CPU kernels need AMX.  Where the model builds, a refit
    equals the fresh load; where it does not, the build says why, typed."""
    scheme = Fp8Scheme(32)
    versions = _versions("qwen3", tmp_path, scheme, count=2)
    try:
        model = build_model(versions[0]["path"])
    except LoaderPathUnsupported as exc:
        assert "could not build and load" in str(exc) and "kernel" in str(exc)
        return
    receiver = Applier(VllmLoader(model),
                       {n: TensorSpec.of(n, t) for n, t in versions[0]["fp8"].items()})  # fmt: skip
    receiver.prewarm()
    bf16 = versions[0]["bf16"]
    names = quantized_names({n: tuple(t.shape) for n, t in bf16.items()})
    rollout = Fp8Rollout(scheme, {n: bf16[n] for n in names})
    items = refit_items(bf16, versions[1]["bf16"], rollout)
    receiver.apply_items(items, attempt=1)
    assert bit_mismatches(model, build_model(versions[1]["path"])) == []


def test_an_fp8_engine_refitted_in_place_equals_a_fresh_fp8_engine(tmp_path: Path) -> None:
    """A running CPU engine on the channel-scaled export (plain-weights load format: the FP8
    weights stay the tensors their loaders wrote, the kernel reads them transposed) takes an
    FP8 refit in place through its native loader; its parameters, greedy tokens and log
    probabilities equal those of an engine started fresh on the next export.  Without the
    plain-weights format a receiver refuses the engine's FP8 layers: their weights were
    re-wrapped after loading."""
    import json
    import subprocess
    import sys

    from engine_helpers import ReferenceRuns, engine_env, fixed_prompts

    from dcr.fleet.config import free_port

    scheme = Fp8Scheme(None)
    versions = _versions("qwen3", tmp_path, scheme, count=2)
    bf16 = [tmp_path / f"bf16-v{v}" for v in range(2)]
    reference = ReferenceRuns.start(tmp_path / "reference", [versions[1]["path"]], tp=1,
                                    max_tokens=8)  # fmt: skip
    ((want_params, want_outputs),) = reference.result()
    out = tmp_path / "refit"
    out.mkdir()
    (out / "prompts.json").write_text(json.dumps(fixed_prompts()))
    script = Path(__file__).parent / "fp8_refit_engine.py"
    for plain in ("yes", "no"):
        argv = [sys.executable, str(script), "--out", str(out), "--prompts",
                str(out / "prompts.json"), "--max-tokens", "8", "--port", str(free_port()),
                "--plain", plain, *map(str, bf16), str(versions[0]["path"])]  # fmt: skip
        done = subprocess.run(argv, env=engine_env(), capture_output=True, timeout=900,
                              stdin=subprocess.DEVNULL)  # fmt: skip
        assert done.returncode == 0, done.stderr.decode()[-3000:]
    with np.load(out / "refit-r0.npz") as f:
        mine = {f"r0/{k}": f[k] for k in f.files}
    assert set(mine) == set(want_params)
    assert [n for n in want_params if not np.array_equal(mine[n], want_params[n])] == []
    got = json.loads((out / "refit.json").read_text())
    assert [o["token_ids"] for o in got] == [o["token_ids"] for o in want_outputs]
    assert [o["logprobs"] for o in got] == [o["logprobs"] for o in want_outputs]
    repacked = json.loads((out / "repacked.json").read_text())
    fp8_layers = [n for n in repacked if n.endswith(("qkv_proj", "o_proj", "gate_up_proj",
                                                     "down_proj"))]  # fmt: skip
    assert fp8_layers and all("FP8 weight replaced" in repacked[n] for n in fp8_layers)


def test_an_fp8_engine_started_by_the_launcher_takes_refits_from_a_bf16_trainer(
    tmp_path: Path,
) -> None:
    """``dcr fleet`` with ``[model] rollout_dtype = "fp8"``: the trainer steps a synthetic run of
    the BF16 checkpoint (``[model] checkpoint``), the engine serves ``dcr fp8 export`` of its
    version 0 (``[[engine]] model``, plain weights), joins without a dense restore (the
    owners' proof covers their FP8 values and scales), takes the FP8 refit in place, and equals
    an engine started fresh on the export of version 1: parameters, tokens, log probabilities."""
    from engine_helpers import OVERRIDES, EngineServer, ReferenceRuns, fixed_prompts, same_floats
    from engine_helpers import bit_mismatches as param_mismatches
    from test_vllm_catalog import ENGINE, _events, _fleet_file

    from dcr.fleet.launcher import Launcher
    from dcr.fleet.model import FleetModel, sized_config
    from dcr.models.synthetic import SyntheticRun

    family, seed, rate = "qwen3", 3, 0.05
    config = sized_config(family, 0, **OVERRIDES[family])
    run = SyntheticRun(config=config, family=family, seed=seed, rate=rate)
    scheme = Fp8Scheme(None)
    bf16 = [write_checkpoint(tmp_path / f"bf16-v{v}", config, family, run.state(v)) for v in (0, 1)]
    fp8 = [tmp_path / f"fp8-v{v}" for v in (0, 1)]
    for src, dst in zip(bf16, fp8, strict=True):
        export_checkpoint(src, dst, scheme)
    engine = ENGINE.replace("plain_weights = true\n", f'plain_weights = true\nmodel = "{fp8[0]}"\n')
    path = _fleet_file(tmp_path / "fleet", bf16[0], engine=engine)
    path.write_text(path.read_text().replace(
        "[model]\n", '[model]\nrollout_dtype = "fp8"\nfp8_block = "channel"\n', 1))  # fmt: skip
    from dcr.fleet.config import load_fleet

    cfg = load_fleet(path)
    assert FleetModel(cfg).wire_catalog == {
        n: TensorSpec.of(n, t) for n, t in read_checkpoint(fp8[0]).items()
    }
    references = ReferenceRuns.start(tmp_path / "reference", fp8[1:], tp=1, max_tokens=8)
    launcher = Launcher(cfg, deadline_s=900)
    seen: dict[str, Any] = {}

    def inspect() -> None:
        server = EngineServer.launched(launcher)
        seen["state"] = server.state()
        seen["parameters"] = server.parameters()
        seen["outputs"] = [server.generate(p, 8) for p in fixed_prompts()]

    try:
        report = launcher.run(before_stop=inspect)
        ((params, outputs),) = references.result()
    finally:
        references.stop()
    assert report["bit_exact"] is True, report["mismatches"]
    (row,) = report["refits"]
    assert row["receivers_checked"] == ["r0"]
    assert not [e for e in _events(cfg.run_dir) if e["event"] in ("dense", "restored")]
    assert seen["state"]["workers"][0]["applied_payloads"] > 0
    assert param_mismatches(seen["parameters"], params) == []
    for out, want in zip(seen["outputs"], outputs, strict=True):
        assert out["token_ids"] == want["token_ids"] and out["version"] == 1
        assert same_floats(out["logprobs"], want["logprobs"])
