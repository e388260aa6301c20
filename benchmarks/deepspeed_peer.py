"""DeepSpeed itself on the benchmark workload, run by bench_training.py inside DeepSpeed's own venv.

    VENV/bin/python benchmarks/deepspeed_peer.py --stage 2 --steps 20 --world 2

Imports only torch, deepspeed, examples/gpt.py and benchmarks' standard-library-and-torch helpers
(and, for a `pipeline.stages` config, the layer list of examples/gpt_pipe.py built with DeepSpeed's
LayerSpec). The model is `--model-json`, else bench_training.py's choice (DSTRAIN_BENCH_MODEL, read by
benchmarks/workload_model.py: an unknown value is an error). Bytes per step and rank follow
benchmarks/comm_bytes.py's one convention (bytes one rank sends): with `comms_logger` in the config,
DeepSpeed's own record converted (its all-gathers log the input shard); for a model held once over
the ranks (pipeline, AutoTP) the dispatch mode of comm_bytes.py, which knows each collective's group.
Prints one JSON line: the slowest rank's median step time and the largest peak RSS.
Settings match bench_training.py's dstrain runs: fp32, torch's AdamW (DeepSpeed's FusedAdam differs
numerically, baselines.md), gradient_clipping 1.0, overlap_comm, reduce_bucket_size 5e6.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.peak_rss import peak_mb, restart_peak  # noqa: E402
from benchmarks.step_phases import StepPhases, kept  # noqa: E402
from benchmarks.storage_io import storage_bytes  # noqa: E402
from benchmarks.comm_bytes import DispatchBytes, bytes_sent, deepspeed_logged_payloads  # noqa: E402
from benchmarks.workload_model import bench_config  # noqa: E402
from examples.gpt import GPT, GPTConfig, RandomTokens  # noqa: E402

MICRO, LR = 8, 1e-4


def _rank(rank: int, world: int, port: int, stage: int, steps: int, outdir: str, model: dict | None = None,
          config: dict | None = None, optimizer: dict | None = None, extra: str = "{}") -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    cfg = config or {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
                     "optimizer": optimizer or {"type": "AdamW", "params": {"lr": LR, "torch_adam": True}},
                     "zero_optimization": {"stage": stage, "overlap_comm": True, "reduce_bucket_size": 5e6}}
    extra_cfg = json.loads(extra)  # e.g. bench_offload.py's offload sections
    cfg.setdefault("zero_optimization", {}).update(extra_cfg.pop("zero_optimization", {}))
    cfg.update(extra_cfg)
    Path(outdir, f"{rank}.json").write_text(json.dumps(_train(deepspeed, cfg, GPTConfig(**model) if model else
                                                              bench_config(), rank, steps)))
    deepspeed.comm.destroy_process_group()  # or a rank may abort at teardown (baselines.md)


def _rank_batch(rank: int, world: int, port: int, items: list, steps: int, outdir: str) -> None:
    """Each {"model", "config"} of `items` in turn in this process (the suite's batches); one row each,
    or {"error": ...}; peak RSS per item from benchmarks/peak_rss.py."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    rows = []
    for item in items:
        restart_peak()
        try:
            row = _train(deepspeed, item["config"], GPTConfig(**item["model"]), rank, steps)
            row["rss_mb"] = peak_mb()
        except Exception as e:  # noqa: BLE001 - one row's failure, not the batch's
            row = {"error": f"{type(e).__name__}: {e}"}
        rows.append(row)
    Path(outdir, f"{rank}.json").write_text(json.dumps(rows))
    deepspeed.comm.destroy_process_group()


def _keep_fp32_under_zero3() -> None:
    """DeepSpeed 0.19.8's `zero.Init._set_dtype` reads `dtype or torch.float16 if is_fp16_supported() else
    torch.bfloat16 if is_bf16_supported else torch.float32`: by precedence the fp32 `dtype` ZeRO-3 passes
    is dropped wherever the accelerator reports no fp16 (a CPU without mkldnn fp16, e.g. an AMD EPYC
    host), and the parameters become bf16 (the forward then fails: "expected m1 and m2 to have the same
    dtype"). Reporting fp16 support makes the expression take `dtype`; this benchmark enables neither
    fp16 nor bf16, so nothing else reads it."""
    from deepspeed.accelerator import get_accelerator
    accelerator = get_accelerator()
    if not accelerator.is_fp16_supported():
        accelerator.is_fp16_supported = lambda: True


def _train(deepspeed, cfg: dict, model_cfg: GPTConfig, rank: int, steps: int) -> dict:
    torch.manual_seed(0)
    if cfg.get("zero_optimization", {}).get("stage") == 3 and not (cfg.get("fp16", {}).get("enabled")
                                                                   or cfg.get("bf16", {}).get("enabled")):
        _keep_fp32_under_zero3()
    micro, gas = cfg["train_micro_batch_size_per_gpu"], cfg.get("gradient_accumulation_steps", 1)
    stages = cfg.get("pipeline", {}).get("stages", 1)
    model = _pipeline_gpt(model_cfg, stages) if stages > 1 else GPT(model_cfg)
    if os.environ.get("DSTRAIN_BENCH_FROZEN") == "1":  # bench_offload's *-frozen rows: a frozen base
        for block in model.blocks:
            block.requires_grad_(False)
    eng, _, _, _ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                        config=cfg)
    from deepspeed.comm import comms_logger
    comms_logger.comms_dict.clear()  # bytes per training step: not initialize's one-time parameter broadcast
    # One model copy over all ranks (pipeline, AutoTP): every rank reads data-parallel rank 0's batches.
    one_copy = stages > 1 or cfg.get("tensor_parallel", {}).get("autotp_size", 1) > 1
    data = RandomTokens(steps * gas * micro, model_cfg.seq_len, model_cfg.vocab_size, seed=0 if one_copy else rank)
    batches = [data[i * micro:(i + 1) * micro] for i in range(steps * gas)]
    times, phases = [], StepPhases()
    # One model copy over the ranks: collectives over groups smaller than the world (the pipeline's
    # data-parallel group of 1, its tied-weight group, sends), which comms_logger does not record, so
    # the dispatch mode counts them, as it does dstrain's rows of that kind (suite_runners).
    # It runs in one step that kept() leaves out of the median (its overhead is on every tensor op).
    seen, count_at = DispatchBytes(), 1 if steps > 4 else 0
    io_first = None  # storage bytes after the first step (its swap files' first writes left out)
    for i in range(steps):
        group = batches[i * gas:(i + 1) * gas]
        with (seen if one_copy and i == count_at else contextlib.nullcontext()):
            t0 = time.perf_counter()
            if stages > 1:
                eng.train_batch(iter(group))
            else:
                for x, y in group:
                    phases.train_step(eng, x, y)
            times.append((time.perf_counter() - t0) * 1e3)
        io_first = storage_bytes() if io_first is None else io_first
    storage_per_step = (storage_bytes() - io_first) / max(1, steps - 1)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    logged = _logged_bytes(steps)
    if one_copy:
        payloads, unknown = dict(seen.payloads), seen.unknown  # one step's
    elif logged is not None:
        payloads, unknown = deepspeed_logged_payloads(logged, int(os.environ["WORLD_SIZE"]))
    else:
        payloads, unknown = None, set()
    sent = None if payloads is None or unknown else bytes_sent(payloads)
    return {"step_ms": statistics.median(kept(times)), "rss_mb": rss, "times_ms": times, "bytes": sent,
            "logged": logged, "uncounted_ops": sorted(unknown), "phases_ms": phases.medians(),
            "storage_bytes_per_step": storage_per_step}


def _pipeline_gpt(cfg: GPTConfig, stages: int):
    """examples/gpt_pipe.py's layer list with DeepSpeed's own LayerSpec/TiedLayerSpec."""
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    from examples.gpt_pipe import gpt_layers, gpt_loss
    return PipelineModule(layers=gpt_layers(cfg, LayerSpec, TiedLayerSpec), num_stages=stages, loss_fn=gpt_loss)


def _logged_bytes(steps: int) -> dict[str, float] | None:
    """{record name: logged bytes per step} of DeepSpeed's comms_logger on this rank (config section
    comms_logger; names are the ops', sizes its own convention: benchmarks/comm_bytes.py converts)."""
    from deepspeed.comm import comms_logger
    if not comms_logger.enabled:
        return None
    return {name: sum(size * entry[0] for size, entry in sizes.items()) / steps
            for name, sizes in comms_logger.comms_dict.items()}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--stage", type=int, required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--model-json", default=None, help="GPTConfig fields as JSON (default: the benchmark GPT)")
    p.add_argument("--config-json", default=None, help="the DeepSpeed config as JSON (default: AdamW at --stage)")
    p.add_argument("--port", type=int, default=0, help="rendezvous port; 0: a free one (a fixed one can still be in "
                   "TIME_WAIT from the previous system's run)")
    p.add_argument("--optimizer", type=json.loads, default=None,
                   help='the config\'s "optimizer" section as JSON (default: torch AdamW); bench_optimizers.py')
    p.add_argument("--extra", default="{}", help="JSON merged into the config (zero_optimization merged key by key)")
    p.add_argument("--batch-json", default=None,
                   help='a list of {"model": GPTConfig fields, "config": ...} run in turn; prints a JSON list of rows')
    args = p.parse_args()
    if args.model_json is None:
        bench_config()  # an unknown DSTRAIN_BENCH_MODEL stops here, in one line, before any rank starts
    if not args.port:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            args.port = s.getsockname()[1]
    if args.batch_json:
        return _batch(args)
    with tempfile.TemporaryDirectory() as outdir:
        model = json.loads(args.model_json) if args.model_json else None
        config = json.loads(args.config_json) if args.config_json else None
        mp.spawn(_rank, args=(args.world, args.port, args.stage, args.steps, outdir, model, config, args.optimizer,
                              args.extra), nprocs=args.world)
        rows = [json.loads(Path(outdir, f"{r}.json").read_text()) for r in range(args.world)]
    print(json.dumps({"step_ms": max(r["step_ms"] for r in rows), "rss_mb": max(r["rss_mb"] for r in rows),
                      "rss_per_rank_mb": [r["rss_mb"] for r in rows], "phases_ms": rows[0]["phases_ms"],
                      "bytes": max((r["bytes"] for r in rows if r["bytes"] is not None), default=None),
                      "storage_bytes_per_step": sum(r["storage_bytes_per_step"] for r in rows)}))
    return 0


def _batch(args) -> int:
    items = json.loads(args.batch_json)
    with tempfile.TemporaryDirectory() as outdir:
        mp.spawn(_rank_batch, args=(args.world, args.port, items, args.steps, outdir), nprocs=args.world)
        per_rank = [json.loads(Path(outdir, f"{r}.json").read_text()) for r in range(args.world)]
    rows = []
    for i in range(len(items)):
        here = [ranks[i] for ranks in per_rank]
        errors = [r["error"] for r in here if "error" in r]
        sent = [r["bytes"] for r in here if r.get("bytes") is not None]
        rows.append({"error": errors[0]} if errors else
                    {"step_ms": max(r["step_ms"] for r in here), "rss_mb": max(r["rss_mb"] for r in here),
                     "bytes": max(sent) if sent else None,
                     "uncounted_ops": sorted({op for r in here for op in r.get("uncounted_ops", [])})})
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
