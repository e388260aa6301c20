"""DeepSpeed's AutoTP on examples/gpt.py, for the suite's tensor-parallel DeepSpeed rows.

    DS_VENV/bin/python benchmarks/deepspeed_gpt_autotp.py      # the check below; prints one JSON line per stage

DeepSpeed 0.19's AutoTP has no policy for this GPT ("Not able to determine model policy automatically").
Its `tensor_parallel.partition_config` (a DeepSpeed-only key: dstrain's AutoTP picks projections by
name and refuses it) names the projections dstrain's AutoTP shards: `qkv` column-parallel in its 3
fused sections, `fc` column-parallel, `proj` and `out` row-parallel; embeddings, head and norms stay
whole. The check: on 2 ranks with that config, ZeRO-1 and ZeRO-3, DeepSpeed trains a 0.02M GPT 2 SGD
steps (linear in the gradient, so a wrong shard or scale shows in the second loss) on one batch and
must give the losses of the same steps of the dense model on one process, and half-width shards.
Imports only torch, deepspeed and examples/gpt.py (it runs in DeepSpeed's venv).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.peer_ranks import spawn_ranks  # noqa: E402
from examples.gpt import GPT, GPTConfig, RandomTokens  # noqa: E402

GPT_AUTOTP_LAYERS = {"use_default_specs": False, "layer_specs": [
    {"patterns": [r".*\.qkv\.weight$"], "partition_type": "column", "shape": [3, -1], "partition_dim": 0},
    {"patterns": [r".*\.fc\.weight$"], "partition_type": "column"},
    {"patterns": [r".*\.proj\.weight$", r".*\.out\.weight$"], "partition_type": "row"}]}
CHECK_MODEL = GPTConfig(vocab_size=256, seq_len=32, n_layer=1, n_head=2, d_model=32)
STEPS, LR = 2, 0.1


def _batch():
    torch.manual_seed(0)
    return GPT(CHECK_MODEL), RandomTokens(8, CHECK_MODEL.seq_len, CHECK_MODEL.vocab_size, seed=0)[0:8]


def dense_losses() -> list[float]:
    model, (x, y) = _batch()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out = []
    for _ in range(STEPS):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def _rank(rank: int, world: int, port: int, stage: int, outdir: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    model, (x, y) = _batch()
    cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "zero_allow_untested_optimizer": True,
           "optimizer": {"type": "SGD", "params": {"lr": LR}}, "zero_optimization": {"stage": stage},
           "tensor_parallel": {"autotp_size": world, "partition_config": GPT_AUTOTP_LAYERS}}
    eng, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    losses = []
    for _ in range(STEPS):
        loss = eng(x, y)
        eng.backward(loss)
        eng.step()
        losses.append(loss.item())
    # ZeRO-3 keeps a parameter's (tensor-parallel) shape in ds_shape while its data is partitioned
    shapes = {n: list(getattr(p, "ds_shape", p.shape)) for n, p in eng.module.named_parameters()}
    Path(outdir, f"{rank}.json").write_text(json.dumps({"losses": losses, "qkv": shapes["blocks.0.qkv.weight"]}))
    deepspeed.comm.destroy_process_group()


def main() -> int:
    dense, failed = dense_losses(), 0
    for stage in (1, 3):
        rows = spawn_ranks(_rank, 2, stage)
        worst = max(abs(a - b) for row in rows for a, b in zip(row["losses"], dense))
        ok = worst < 1e-5 and all(row["qkv"] == [3 * CHECK_MODEL.d_model // 2, CHECK_MODEL.d_model] for row in rows)
        failed += not ok
        print(json.dumps({"zero_stage": stage, "dense_losses": dense, "deepspeed_autotp_losses": rows[0]["losses"],
                          "qkv_shard": rows[0]["qkv"], "max_abs_diff": worst, "ok": ok}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
