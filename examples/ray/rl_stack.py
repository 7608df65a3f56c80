"""A Ray RL stack in the shape verl and OpenRLHF use, with dcr as its weight sync.

A trainer worker group (two FSDP2 ranks in a gloo group, each an actor), a rollout actor
holding a vLLM ``AsyncLLM``, and a driver loop: generate, train, sync.  dcr's own roles (the
coordinators and the relay tree) run as actors beside them (:class:`dcr.ray.RayFleet`).  With
dcr the weight sync is one call on each side:

* trainer side, after every optimizer step: ``await trainer.publish()`` -- returns once the new
  version is committed in every rollout engine;
* rollout side, once: ``join_fleet(engine, cfg, ["r0"])`` -- the engine's workers become the
  fleet's receivers and apply every version as it comes.

Run it on a cluster whose nodes carry the ``trainer`` and ``rollout`` resources (``ray start
--resources '{"trainer": 4}'`` on trainer nodes, ``'{"rollout": 1}'`` on rollout nodes) with
``python examples/ray/rl_stack.py --address auto``, or on a local cluster of four nodes that
it starts itself (``--local``; on a shared machine inside ``unshare -n python -m
dcr.ray.netns``).  It prints one line per step and, at the end, the version the engine
holds (committed only once every worker proved it holds the trainer's bits).  Needs vLLM
and Ray (``pip install 'dcr[rl,ray]'``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any

import ray

NAMESPACE = "dcr-example"
FLEET = f"""
[fleet]
name = "example"
run_dir = "run"
keys = "keys"

[model]
checkpoint = "checkpoint-v0"

[trainer]
kind = "ray-stack"  # the stack starts the ranks itself: any name but "synthetic"
ranks = 2

[coordinator]
sync = true

[ray]
namespace = "{NAMESPACE}"
coordinators = 2

[[rollout]]
name = "node0"
receivers = [{{ name = "r0", tp = 1, rank = 0 }}]

[[engine]]  # the rollout actor's engine: its worker is receiver r0
name = "e0"
receivers = ["r0"]
plain_weights = true
checkpoint_version = 0
"""

ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache: the CPU build's default is far larger
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # share the node's cores with the other actors
    "OMP_NUM_THREADS": "1",
}


@ray.remote(num_cpus=1, resources={"trainer": 0.001})
class TrainerWorker:
    """One rank of the trainer: its FSDP2 shard of the policy, in the group's gloo group."""

    def __init__(
        self, rank: int, world: int, port: int, checkpoint: str, config: dict[str, Any]
    ) -> None:
        import torch.distributed as dist

        from dcr.rl.config import RLConfig
        from dcr.rl.trainer import FsdpPolicy

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        self.config = RLConfig.from_dict(config)
        self.policy = FsdpPolicy(checkpoint, self.config)
        self.trainer: Any = None
        self._joined = asyncio.Event()
        self._stop = asyncio.Event()

    async def join(self) -> None:
        """Join the fleet as this rank's owner (collective: every rank at once)."""
        asyncio.get_running_loop().create_task(self._serve())
        await self._joined.wait()

    async def _serve(self) -> None:
        import dcr
        from dcr.ray import fleet_config

        cfg = await asyncio.to_thread(fleet_config, "example", namespace=NAMESPACE)
        source = await asyncio.to_thread(self.policy.source)
        async with dcr.join_trainer(source, cfg, version=0) as trainer:
            self.trainer = trainer
            self._joined.set()
            await self._stop.wait()

    async def train(self, batch: dict[str, Any]) -> dict[str, Any]:
        from dcr.rl.grpo import Rollouts

        rollouts = Rollouts.build(batch["prompts"], batch["responses"], batch["logprobs"],
                                  batch["rewards"], group_size=self.config.group_size)  # fmt: skip
        metrics = await asyncio.to_thread(self.policy.step, rollouts)
        return metrics.as_dict()

    async def sync_weights(self) -> int:
        """The weight sync: publish this step's weights; the committed version."""
        record = await self.trainer.publish(donate=True)
        return int(record.version)


@ray.remote(num_cpus=0)
class RolloutActor:
    """A rollout engine: vLLM's ``AsyncLLM``, its workers dcr receivers."""

    def __init__(self, checkpoint: str, config: dict[str, Any]) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        import dcr.integrations.vllm.plain  # noqa: F401  (the CPU plain-weights load format)
        from dcr.integrations.vllm import EXTENSION, PLAIN_WEIGHTS

        self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
            model=checkpoint, skip_tokenizer_init=True, enforce_eager=True, max_model_len=64,
            worker_extension_cls=EXTENSION, load_format=PLAIN_WEIGHTS,
            distributed_executor_backend="uni", enable_prefix_caching=False,
            enable_chunked_prefill=False,
        ))  # fmt: skip
        self.config = config
        self._joined = asyncio.Event()
        self._stop = asyncio.Event()

    async def join(self) -> None:
        asyncio.get_running_loop().create_task(self._serve())
        await self._joined.wait()

    async def _serve(self) -> None:
        from dcr.integrations.vllm.engine import join_fleet
        from dcr.ray import fleet_config

        cfg = await asyncio.to_thread(fleet_config, "example", namespace=NAMESPACE)
        async with join_fleet(self.engine, cfg, ["r0"], checkpoint_version=0):
            self._joined.set()
            await self._stop.wait()

    async def generate(self, step: int, version: int, seed: int = 0) -> dict[str, Any]:
        """Step ``step``'s rollouts from weights of ``version``: seeded samples of the task's
        prompts, with rewards and the version that produced them."""
        await self.held(version)
        from dcr.integrations.vllm.generation import BatchRequest, generate_batch
        from dcr.rl.config import RLConfig
        from dcr.rl.task import SymbolTask

        cfg = RLConfig.from_dict(self.config)
        task = SymbolTask.of(cfg)
        prompts = task.prompts(seed, step, cfg.prompts_per_step)
        requests = [
            BatchRequest(
                prompt_token_ids=tuple(p),
                max_tokens=cfg.response_len,
                temperature=cfg.temperature,
                seed=task.sampling_seed(seed, step, i, j),
                ignore_eos=True,
            )
            for i, p in enumerate(prompts)
            for j in range(cfg.group_size)
        ]
        done = await generate_batch(self.engine, requests)
        responses = [list(g.token_ids) for g in done]
        return {
            "prompts": prompts,
            "responses": responses,
            "logprobs": [list(g.logprobs or ()) for g in done],
            "rewards": [
                task.reward(prompts[k // cfg.group_size], r) for k, r in enumerate(responses)
            ],
            "versions": sorted({g.record.version for g in done if g.record is not None}),
        }

    async def held(self, version: int, timeout_s: float = 120.0) -> int:
        """Wait until the engine's weights are labelled ``version`` or later (every worker
        applied it, and the fleet committed it once each proved it); the version held."""
        from dcr.integrations.vllm.engine import gate_of

        gate = gate_of(self.engine)
        for _ in range(int(timeout_s / 0.05)):
            if gate.record is not None and gate.record.version >= version:
                return int(gate.record.version)
            await asyncio.sleep(0.05)
        raise TimeoutError(f"the engine did not hold version {version} in {timeout_s:g} s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--address", help="the Ray cluster to connect to (e.g. auto)")
    p.add_argument("--local", action="store_true", help="start a local four-node cluster")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--dir", default=None, help="where the checkpoint and fleet file go")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--group-size", type=int, default=8, help="completions per prompt")
    args = p.parse_args(argv)
    with contextlib.ExitStack() as stack:
        if args.local:
            from dcr.ray.cluster import local_cluster

            stack.enter_context(local_cluster(say=print))
        else:
            ray.init(address=args.address, namespace=NAMESPACE)
        work = Path(args.dir or stack.enter_context(tempfile.TemporaryDirectory()))
        return _run(work, args.steps, {"prompts_per_step": args.prompts,
                                       "group_size": args.group_size})  # fmt: skip
    return 1


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(work: Path, steps: int, config: dict[str, Any]) -> int:
    """The loop; ``config``: :class:`~dcr.rl.config.RLConfig` fields that differ from the
    defaults, the same in every actor."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from dcr.fleet.config import load_fleet
    from dcr.ray import RayFleet
    from dcr.rl.config import RLConfig
    from dcr.rl.policy import write_initial_checkpoint

    checkpoint = work / "checkpoint-v0"
    write_initial_checkpoint(checkpoint, seed=0, config=RLConfig.from_dict(config))
    (work / "fleet.toml").write_text(FLEET)
    cfg = load_fleet(work / "fleet.toml")
    cfg.ensure_keys()
    fleet = RayFleet(cfg)  # dcr's own roles: coordinators, relay nodes, the directory
    fleet.start()
    try:
        node = NodeAffinitySchedulingStrategy(fleet.placement.rollout["node0"], soft=False)
        rollout = RolloutActor.options(
            scheduling_strategy=node, runtime_env={"env_vars": ENGINE_ENV}
        ).remote(str(checkpoint), config)
        port = _free_port()  # the trainer group's rendezvous (rank 0 listens there)
        workers = [
            TrainerWorker.remote(rank, 2, port, str(checkpoint), config) for rank in range(2)
        ]
        ray.get([rollout.join.remote(), *[w.join.remote() for w in workers]])
        for step in range(1, steps + 1):
            batch = ray.get(rollout.generate.remote(step, version=step - 1))
            metrics = ray.get([w.train.remote(batch) for w in workers])[0]
            version = ray.get([w.sync_weights.remote() for w in workers])[0]  # the weight sync
            print(f"step {step}: rollouts of version {batch['versions']}, reward "
                  f"{metrics['reward']:.4f}, committed version {version}")  # fmt: skip
        print(f"the engine holds version {ray.get(rollout.held.remote(steps))}")
    finally:
        fleet.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
