"""Real optimizer updates against the synthetic workloads: change rates and payload bytes.

A Hugging Face Qwen3 model (random init, ~13M parameters) trains on random tokens with PyTorch
AdamW on fp32 master weights; after every step the bf16 weights (what a rollout engine serves)
are refit through dcr's data plane (one owner, one receiver, mixed mode).  Reported per
learning rate: the fraction of bf16 elements whose stored bits changed per step, and dcr's
payload bytes per changed element; then the same for the synthetic workloads (1/3/5 % of the
elements updated by a relative 1e-2) on the same weights.  Needs transformers (run it in
.venv-megatron or .venv-vllm):

    .venv-megatron/bin/python scripts/real-updates.py --json
"""

from __future__ import annotations

import argparse
import json
import logging
import warnings

import torch

from dcr import StateDictSource, TorchModuleLoader, TrainLayout
from dcr.local import DataPlane
from dcr.models.modules import module_from_state_dict
from dcr.models.updates import perturb

BF16 = torch.bfloat16


def model(seed: int) -> torch.nn.Module:
    import transformers

    config = transformers.Qwen3Config(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return transformers.Qwen3ForCausalLM(config).float()


def served(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().to(BF16) for n, p in m.named_parameters()}


def refit_rows(weights: list[dict[str, torch.Tensor]]) -> list[dict[str, float]]:
    """Refit each version after the first into a receiver of the first; one row per refit."""
    first = weights[0]
    source = StateDictSource(first, layout=TrainLayout())
    receiver = TorchModuleLoader(module_from_state_dict(first))
    total = sum(t.numel() for t in first.values())
    rows = []
    with DataPlane(source, [receiver]) as plane:
        for w in weights[1:]:
            report = plane.refit(w)
            rows.append(
                {
                    "changed_fraction": report.changed_elements / total,
                    "bytes_per_changed_element": report.bytes_per_changed_element,
                    "payload_bytes": report.payload_bytes,
                }
            )
    return rows


def train(lr: float, steps: int, seed: int) -> list[dict[str, torch.Tensor]]:
    m = model(seed)
    opt = torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed + 1)
    out = [served(m)]
    for _ in range(steps):
        tokens = torch.randint(0, 4096, (8, 65), generator=gen)
        loss = m(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(served(m))
    return out


def _mean(rows: list[dict[str, float]], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows)


def main() -> None:
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--lr", type=float, nargs="+", default=[1e-6, 1e-5, 1e-4])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args()
    torch.set_num_threads(2)
    results: dict[str, object] = {"model": "qwen3 4x256 (13M parameters), AdamW fp32 master"}
    real = []
    for lr in args.lr:
        rows = refit_rows(train(lr, args.steps, args.seed))
        real.append(
            {
                "lr": lr,
                "steps": rows,
                "changed_fraction": _mean(rows, "changed_fraction"),
                "bytes_per_changed_element": _mean(rows, "bytes_per_changed_element"),
            }
        )
    base = served(model(args.seed))
    synthetic = []
    for rate in (0.01, 0.03, 0.05):
        (row,) = refit_rows([base, perturb(base, rate=rate, seed=args.seed + 7)])
        synthetic.append({"rate": rate, **row})
    results.update(real=real, synthetic=synthetic)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(results["model"])
    print(f"{'workload':>18} {'changed/step':>13} {'B/changed':>10}")
    for r in real:
        print(
            f"{'AdamW lr=' + format(r['lr'], 'g'):>18} {r['changed_fraction']:>13.4%} "
            f"{r['bytes_per_changed_element']:>10.3f}"
        )
    for s in synthetic:
        print(
            f"{'synthetic ' + format(s['rate'], '.0%'):>18} {s['changed_fraction']:>13.4%} "
            f"{s['bytes_per_changed_element']:>10.3f}"
        )


if __name__ == "__main__":
    main()
