"""Demo: the GPT of examples/gpt.py split into pipeline stages (engine.pipe), from a config file.

    dslaunch --num_gpus 2 examples/train_gpt_pipe.py --deepspeed_config sample_configs/pipe2.json
    dslaunch --num_gpus 4 examples/train_gpt_pipe.py --deepspeed_config sample_configs/dp2_pipe2.json
    dslaunch --num_gpus 4 examples/train_gpt_pipe.py --deepspeed_config sample_configs/pipe2_tp2.json
    dslaunch --num_gpus 8 examples/train_gpt_pipe.py --deepspeed_config sample_configs/dp2_pipe2_tp2.json

The stage count is the config's `pipeline.stages`, the tensor-parallel degree its
`tensor_parallel.autotp_size` (AutoTP shards the dense blocks; with `--tensor-parallel-layers` the
blocks are built from engine.tensor_parallel's layers instead); the data-parallel degree is what the
world leaves (world / (stages × degree)); `pipeline.schedule` picks the schedule. Each step is one
`engine.train_batch()`.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

import engine  # noqa: E402
import schemas  # noqa: E402
from engine.display import TrainingProgress, print_summary  # noqa: E402
from engine.pipe import PipelineModule  # noqa: E402
from engine.tensor_parallel import from_config as tensor_parallel  # noqa: E402
from engine.topology import Topology  # noqa: E402
from examples.gpt import ByteCorpus, GPTConfig, uniform_loss  # noqa: E402
from examples.gpt_pipe import gpt_layers, gpt_loss  # noqa: E402

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "sample_configs" / "pipe2.json"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30, help="optimizer steps (train_batch calls)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--threads", type=int, default=0, help="intra-op threads per rank (0: cores / local ranks)")
    p.add_argument("--tensor-parallel-layers", action="store_true",
                   help="build the blocks from engine.tensor_parallel layers (else AutoTP shards dense ones)")
    engine.add_config_arguments(p)
    args = p.parse_args(argv)
    args.deepspeed_config = args.deepspeed_config or str(DEFAULT_CONFIG)
    return args


def _topology(config_path: str) -> Topology:
    """pipe × data × model from the config's `pipeline.stages` and `tensor_parallel.autotp_size`."""
    body, _ = schemas.loading.read_config_source(config_path)
    stages = body.get("pipeline", {}).get("stages", "auto")
    if not isinstance(stages, int):
        raise SystemExit(f"{config_path}: pipeline.stages must be a number of stages for this demo")
    degree = tensor_parallel.requested_degree(config_path, None)
    return Topology.for_world(dist.get_world_size(), pipe=stages, model=degree)


def main(argv=None) -> int:
    args = parse_args(argv)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // local_world))
    cfg = GPTConfig(seq_len=args.seq_len, n_layer=args.layers, d_model=args.d_model, n_head=4)
    engine.init_distributed()
    model = PipelineModule(gpt_layers(cfg, tensor_parallel=args.tensor_parallel_layers),
                           topology=_topology(args.deepspeed_config), loss_fn=gpt_loss, seed_layers=True,
                           partition_method="type:BlockLayer")
    eng, _, _, _ = engine.initialize(args=args, model=model, training_data=ByteCorpus(seq_len=args.seq_len))
    losses, t0 = [], time.perf_counter()
    progress = TrainingProgress(args.steps, dist.get_rank())  # rank 0 only; a live bar on a terminal
    tokens_per_step = eng.train_batch_size() * args.seq_len
    while eng.global_steps < args.steps:
        losses.append(float(eng.train_batch()))
        progress.update(eng.global_steps, losses[-1], tokens_per_step * len(losses) / (time.perf_counter() - t0))
    elapsed = time.perf_counter() - t0
    progress.close()
    eng.destroy()
    if dist.get_rank() == 0:
        first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
        topo = model.topology
        print(f"[dstrain] pipeline demo done: {eng.global_steps} steps, pipe={topo.pipe} × data={topo.data} × "
              f"model={topo.model}, "
              f"schedule {eng.schedule_name}, loss {first:.3f} -> {last:.3f} (uniform {uniform_loss(256):.3f}), "
              f"{elapsed / len(losses) * 1000:.0f} ms/step")
        print_summary("dstrain pipeline demo", [
            ("steps", f"{eng.global_steps} on {dist.get_world_size()} rank(s)"),
            ("grid", f"pipe {topo.pipe} × data {topo.data} × model {topo.model}, schedule {eng.schedule_name}"),
            ("loss", f"{first:.3f} -> {last:.3f}"), ("tokens/s", f"{tokens_per_step * len(losses) / elapsed:,.0f}"),
            ("time", f"{elapsed:.1f} s")], [], 0)
        if not last < first:
            raise SystemExit("[dstrain] the loss did not fall — something is wrong")
    return 0


if __name__ == "__main__":
    sys.exit(main())
