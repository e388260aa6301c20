"""DeepSpeed's AutoTP on the tensor-parallel benchmark model, run by bench_tensor_parallel.py inside
DeepSpeed's own venv (it imports only torch, transformers and deepspeed, never dstrain).

    VENV/bin/python benchmarks/deepspeed_autotp_peer.py --steps 8 --world 2

Prints one JSON line: the slowest rank's median step time and the largest peak RSS.
`bench_model()` is the one model both sides train: a Llama-style HF model at the benchmark GPT's
sizes (examples/gpt.py BENCH_CONFIG: 6 layers, d 512, 8 heads, vocab 12000, 128 tokens; MLP 1376).
Llama, not GPT-2: DeepSpeed 0.19.8's AutoTP refuses GPT-2 ("AutoTP not supported for model", it has
a kernel-injection policy instead).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

GLOBAL_BATCH, SEQ, VOCAB, LR = 8, 128, 12_000, 1e-4


def bench_model():
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=512, intermediate_size=1376, num_hidden_layers=6,
                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=SEQ)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def bench_batches(steps: int, micro: int, data_rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(data_rank)
    return [torch.randint(0, VOCAB, (micro, SEQ), generator=g) for _ in range(steps)]


def median_ms(times: list[float]) -> float:
    return statistics.median(times[2:-1] if len(times) > 4 else times)


def _rank(rank: int, world: int, port: int, tp: int, steps: int, outdir: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    data = world // tp
    cfg = {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // data, "gradient_accumulation_steps": 1,
           "gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"lr": LR, "torch_adam": True}},
           "zero_optimization": {"stage": 1}, "tensor_parallel": {"autotp_size": tp}}
    model = bench_model()
    eng, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    times = []
    for ids in bench_batches(steps, GLOBAL_BATCH // data, rank // tp):
        t0 = time.perf_counter()
        eng.backward(eng(input_ids=ids, labels=ids).loss)
        eng.step()
        times.append((time.perf_counter() - t0) * 1e3)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    Path(outdir, f"{rank}.json").write_text(json.dumps({"step_ms": median_ms(times), "rss_mb": rss}))
    deepspeed.comm.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--tp", type=int, default=2)
    args = p.parse_args()
    from benchmarks.peer_ranks import spawn_ranks  # the repository root is on the path from here (below)
    rows = spawn_ranks(_rank, args.world, args.tp, args.steps)
    print(json.dumps({"step_ms": max(r["step_ms"] for r in rows), "rss_mb": max(r["rss_mb"] for r in rows)}))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.exit(main())
