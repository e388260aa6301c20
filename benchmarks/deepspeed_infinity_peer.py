"""DeepSpeed itself on bench_infinity.py's ZeRO-Infinity run, inside DeepSpeed's own venv.

    VENV/bin/python benchmarks/deepspeed_infinity_peer.py --model-json '{...}' --config-json '{...}' --steps 3

bench_infinity.py's `--deepspeed-venv` calls this with its own GPT and config (ZeRO-3, parameters and
optimizer on NVMe under the config's `nvme_path`, the `aio` section), so both systems run the same
thing: each rank builds the GPT under `deepspeed.zero.Init(remote_device="nvme")`, trains `--steps`
steps on one fixed micro-batch (the loss falls when the updates reach the weights) and reports its
losses, step times, peak RSS (ru_maxrss, and above the RSS at the rank's start with torch and
deepspeed imported) and the bytes it read from and wrote to storage (/proc/self/io). DeepSpeed steps
AdamW with its DeepSpeedCPUAdam (it refuses a torch optimizer under offload) and swaps through its
JIT-built async_io op (Debian's libaio-dev). Prints one JSON list, one object per rank, or
{"error": ...} for a rank that raised (a config DeepSpeed refuses is a figure too).
Imports only torch, deepspeed, psutil and examples/gpt.py.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples.gpt import GPT, GPTConfig, RandomTokens  # noqa: E402
from benchmarks.infinity_agreement import dump_full_params  # noqa: E402
from benchmarks.step_phases import fixed_batch_steps  # noqa: E402


def _io() -> dict:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f)}


def _progress(rank: int, t0: float, what: str) -> None:
    """A line on stderr per phase: a large run that is killed (memory, time) still says how far it got."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"[deepspeed rank {rank}] {time.perf_counter() - t0:.0f} s: {what} (peak RSS {rss:.2f} GiB)",
          file=sys.stderr, flush=True)


def _train(deepspeed, model_cfg: GPTConfig, cfg: dict, steps: int, rank: int, dump: str | None = None) -> dict:
    import psutil
    rss_start = psutil.Process().memory_info().rss
    io0, t0 = _io(), time.perf_counter()
    torch.manual_seed(0)
    # bench_infinity.remote_device: the parameter tier (bench_infinity cannot be imported in this venv)
    remote = cfg["zero_optimization"].get("offload_param", {}).get("device")
    with deepspeed.zero.Init(remote_device=remote, config_dict_or_path=cfg):
        model = GPT(model_cfg)
    _progress(rank, t0, "zero.Init built the model")
    eng, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    built_s = time.perf_counter() - t0
    _progress(rank, t0, "deepspeed.initialize returned")
    rss_built = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    x, y = RandomTokens(cfg["train_micro_batch_size_per_gpu"], model_cfg.seq_len, model_cfg.vocab_size, seed=rank)[:]
    losses, times, norms = fixed_batch_steps(eng, x, y, steps, on_step=lambda k: _progress(rank, t0, f"step {k} done"))
    io1 = _io()
    out = {"losses": losses, "step_s": times, "norms": norms, "build_s": built_s, "rss_start": rss_start,
           "rss_after_build": rss_built, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
           "disk_read": io1["read_bytes"] - io0["read_bytes"], "disk_written": io1["write_bytes"] - io0["write_bytes"]}
    if dump:  # after the byte counts: gathering every parameter swaps the optimizer state in
        from deepspeed.utils import safe_get_full_fp32_param
        dump_full_params(model, safe_get_full_fp32_param, dump, rank)
    return out


def _rank(rank: int, world: int, port: int, model: dict, cfg: dict, steps: int, outdir: str,
          dump: str | None = None) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # as bench_infinity.py's ranks: two ranks share the machine's cores
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    try:
        out = _train(deepspeed, GPTConfig(**model), cfg, steps, rank, dump)
    except Exception as e:  # noqa: BLE001 - DeepSpeed refusing the config is the peer's figure
        out = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:500], "where": traceback.format_exc()[-1500:]}
    Path(outdir, f"{rank}.json").write_text(json.dumps(out))
    deepspeed.comm.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model-json", required=True, help="GPTConfig fields as JSON")
    p.add_argument("--config-json", required=True, help="the DeepSpeed config as JSON (bench_infinity.ds_config)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--dump", default=None, help="rank 0 saves the full fp32 parameters after the last step here "
                   "(bench_infinity.py --check-against-torch)")
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as outdir:
        mp.spawn(_rank, args=(args.world, port, json.loads(args.model_json), json.loads(args.config_json),
                              args.steps, outdir, args.dump), nprocs=args.world)
        rows = [json.loads(Path(outdir, f"{r}.json").read_text()) for r in range(args.world)]
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
