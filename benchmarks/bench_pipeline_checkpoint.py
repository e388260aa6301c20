"""Pipeline checkpoint save and load time against the same model without a pipeline, on the same ranks.

    python benchmarks/bench_pipeline_checkpoint.py [--world 4] [--mb 64] [--repeats 3] [--dir /tmp/x]

One run of `--world` processes (gloo, CPU) builds a PipelineModule of Linear layers holding about
`--mb` MiB of fp32 weights (ZeRO-1, SGD with momentum: weights + momentum = 2x that on disk) twice: as
2 pipeline stages × world/2 data ranks, and as 1 stage × world data ranks. For each it reports the best
of `--repeats` synchronous `save_checkpoint` wall times (hashing, fsync, commit included, after a first
save that also creates the checkpoint group) and `load_checkpoint` times (verification included; the
files are in the page cache: this measures the engine, not the disk), and loads the 2-stage checkpoint
at world data ranks (the reshard across stage counts). Each rank writes only its share, so the pipeline
layout should cost about what the flat one does. The same weights as `--layers`/2 MLP blocks under
`tensor_parallel.autotp_size: 2` (2 model × world/2 data) give the tensor-parallel row: save, load
into the same grid, and load at `world` model ranks (the reshard across degrees, which joins each
parameter's shards and cuts the rank's own on every rank: engine/checkpoint/tensor_shards.py).
The pipeline × tensor-parallel row is examples/gpt_pipe.py's GPT (4 blocks, width chosen for about
`--mb` MiB) as 2 stages that AutoTP shards over 2 model ranks: save, load into the same grid, and load
at 1 stage × `world` data ranks (dense: the reshard across stage count and degree at once).
The HF GPT-2 row is transformers' GPT2LMHeadModel (`Conv1D` projections stored (in, out), 2 blocks,
width for about `--mb` MiB) at `autotp_size: 2`: save, load into the same grid, load at `world` model
ranks, and load into the plain Conv1D model on `world` data ranks (each Conv1D weight's shards joined
and transposed to the dense orientation: tensor_shards.py's note on HF Conv1D).
Output: one JSON object.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.harness import run_distributed  # noqa: E402


def _engine(stages: int, width: int, layers: int, save_dir: str):
    import torch.nn as nn

    import engine
    from engine.pipe import LayerSpec, PipelineModule
    specs = [LayerSpec(nn.Linear, width, width) for _ in range(layers)]
    pm = PipelineModule(specs, num_stages=stages, loss_fn=nn.functional.mse_loss, partition_method="uniform")
    eng, *_ = engine.initialize(model=pm, config={
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.01, "momentum": 0.9}},
        "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": 1},
        "checkpoint": {"save_dir": save_dir}})
    return eng


def _timed(fn, repeats: int) -> float:
    import torch.distributed as dist
    best = float("inf")
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _case(stages: int, width: int, layers: int, save_dir: str, repeats: int) -> dict:
    import torch
    eng = _engine(stages, width, layers, save_dir)
    x = torch.randn(1, width, device="cpu")
    eng.train_batch(iter([(x, x)]))  # momentum exists
    eng.save_checkpoint(save_dir, tag="first")
    save = _timed(lambda: eng.save_checkpoint(save_dir, tag="t"), repeats)
    load = _timed(lambda: eng.load_checkpoint(save_dir, tag="t"), repeats)
    eng.destroy()
    return {"save_s": round(save, 4), "load_s": round(load, 4)}


class _Block:  # built in the rank (torch is imported there)
    @staticmethod
    def model(width: int, blocks: int):
        import torch.nn as nn

        class Block(nn.Module):  # AutoTP's names: `fc` column-parallel, `out` row-parallel
            def __init__(self):
                super().__init__()
                self.fc, self.out = nn.Linear(width, width), nn.Linear(width, width)

        class MLP(nn.Module):
            def __init__(self):
                super().__init__()
                self.blocks = nn.ModuleList(Block() for _ in range(blocks))

            def forward(self, x):
                for b in self.blocks:
                    x = b.out(b.fc(x))
                return x.pow(2).mean()
        return MLP()


def _tp_engine(width: int, layers: int, degree: int):
    import engine
    eng, *_ = engine.initialize(model=_Block.model(width, max(1, layers // 2)), config={
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.01, "momentum": 0.9}},
        "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": 1},
        "tensor_parallel": {"autotp_size": degree}})
    return eng


def _save_load_times(eng, base: str, repeats: int) -> tuple[float, float]:
    """Seconds to save and to load tag "t" under `base` (after an untimed first save), then destroy."""
    eng.save_checkpoint(base, tag="first")
    save = _timed(lambda: eng.save_checkpoint(base, tag="t"), repeats)
    load = _timed(lambda: eng.load_checkpoint(base, tag="t"), repeats)
    eng.destroy()
    return save, load


def _tp_case(width: int, layers: int, base: str, repeats: int) -> dict:
    import torch
    import torch.distributed as dist
    eng = _tp_engine(width, layers, 2)
    eng.backward(eng(torch.randn(1, width, device="cpu")))
    eng.step()  # momentum exists
    save, load = _save_load_times(eng, base, repeats)
    world = dist.get_world_size()
    eng = _tp_engine(width, layers, world)
    reshard = _timed(lambda: eng.load_checkpoint(base, tag="t"), repeats)
    eng.destroy()
    return {f"model2_x_data{world // 2}": {"save_s": round(save, 4), "load_s": round(load, 4)},
            f"load_model2_ckpt_at_model{world}_s": round(reshard, 4)}


def _sgd_config(tp_degree: int) -> dict:
    """ZeRO-1 SGD with momentum (state to save), AutoTP at `tp_degree` when it is above 1."""
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "SGD", "params": {"lr": 0.01, "momentum": 0.9}},
              "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": 1}}
    if tp_degree > 1:
        config["tensor_parallel"] = {"autotp_size": tp_degree}
    return config


def _pipe_tp_engine(d_model: int, pipe: int, model: int):
    import torch.distributed as dist

    import engine
    from engine.pipe import PipelineModule
    from engine.topology import Topology
    from examples.gpt import GPTConfig
    from examples.gpt_pipe import gpt_layers, gpt_loss
    cfg = GPTConfig(vocab_size=256, seq_len=16, n_layer=4, n_head=8, d_model=d_model)
    pm = PipelineModule(gpt_layers(cfg), topology=Topology.for_world(dist.get_world_size(), pipe=pipe, model=model),
                        loss_fn=gpt_loss, partition_method="type:BlockLayer")
    eng, *_ = engine.initialize(model=pm, config=_sgd_config(model))
    return eng


def _pipe_tp_case(mb: float, base: str, repeats: int) -> dict:
    import torch
    import torch.distributed as dist
    d_model = max(64, int((mb * 2**20 / 4 / 48) ** 0.5)) // 64 * 64  # 4 blocks of 12 d² weights
    eng = _pipe_tp_engine(d_model, 2, 2)
    x = torch.randint(0, 256, (1, 16), device="cpu")
    eng.train_batch(iter([(x, x)]))  # momentum exists
    save, load = _save_load_times(eng, base, repeats)
    eng = _pipe_tp_engine(d_model, 1, 1)
    reshard = _timed(lambda: eng.load_checkpoint(base, tag="t"), repeats)
    eng.destroy()
    world = dist.get_world_size()
    return {"d_model": d_model, f"pipe2_x_model2_x_data{world // 4}": {"save_s": round(save, 4), "load_s": round(load, 4)},
            f"load_at_pipe1_x_data{world}_s": round(reshard, 4)}


def _hf_engine(n_embd: int, degree: int):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    import engine
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=1024, n_positions=16, n_embd=n_embd, n_layer=2, n_head=8))
    eng, *_ = engine.initialize(model=model, config=_sgd_config(degree))
    return eng


def _hf_case(mb: float, base: str, repeats: int) -> dict:
    import torch
    import torch.distributed as dist
    n_embd = max(64, int((mb * 2**20 / 4 / 24) ** 0.5)) // 64 * 64  # 2 blocks of 12 d² weights
    eng = _hf_engine(n_embd, 2)
    x = torch.randint(0, 1024, (1, 16), device="cpu")
    eng.backward(eng(input_ids=x, labels=x).loss)
    eng.step()  # momentum exists
    save, load = _save_load_times(eng, base, repeats)
    world = dist.get_world_size()
    out = {"n_embd": n_embd, f"model2_x_data{world // 2}": {"save_s": round(save, 4), "load_s": round(load, 4)}}
    for degree, key in ((world, f"load_at_model{world}_s"), (1, f"load_into_dense_conv1d_x_data{world}_s")):
        eng = _hf_engine(n_embd, degree)
        out[key] = round(_timed(lambda: eng.load_checkpoint(base, tag="t"), repeats), 4)  # noqa: B023 - called now
        eng.destroy()
    return out


def _all(width: int, layers: int, base: str, repeats: int, mb: float) -> dict:
    import torch.distributed as dist
    world = dist.get_world_size()
    out = {}
    for stages in (2, 1):
        out[f"pipe{stages}_x_data{world // stages}"] = _case(stages, width, layers, f"{base}/p{stages}", repeats)
    eng = _engine(1, width, layers, f"{base}/p2")
    reshard = _timed(lambda: eng.load_checkpoint(f"{base}/p2", tag="t"), repeats)
    out[f"load_pipe2_ckpt_at_data{world}_s"] = round(reshard, 4)
    eng.destroy()
    out["tensor_parallel"] = _tp_case(width, layers, f"{base}/tp", repeats)
    out["hf_gpt2_tensor_parallel"] = _hf_case(mb, f"{base}/hf", repeats)
    if world % 4 == 0:
        out["pipe_x_tensor_parallel"] = _pipe_tp_case(mb, f"{base}/ptp", repeats)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--mb", type=float, default=64.0)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default="/tmp/dstrain-bench-pipe-ckpt")
    args = parser.parse_args()
    width = max(8, int((args.mb * 2**20 / 4 / args.layers) ** 0.5)) // 8 * 8  # splits over 2 and 4 model ranks
    shutil.rmtree(args.dir, ignore_errors=True)
    try:
        rows = run_distributed(_all, world_size=args.world, args=(width, args.layers, args.dir, args.repeats, args.mb),
                               timeout=1200)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    result = {"world": args.world, "weights_mib": round(width * width * args.layers * 4 / 2**20, 1),
              "width": width, "layers": args.layers, **rows[0]}
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
