"""Bytes per step and step time of Adam, OneBitAdam, ZeroOneAdam and Adam + PowerSGD on 2 ranks, over
loopback and over a bandwidth-limited link (two network namespaces joined by a veth pair, `tc tbf`).

    sudo python benchmarks/bench_compression.py --links loopback,veth --rate 1gbit

Workload: the benchmark GPT of baselines.md (25.12M parameters, fp32) with a small batch (micro-batch
1 x 32 tokens per rank), so that gradient communication, not compute, bounds a step on a slow link —
the regime 1-bit Adam is for (large models, small per-rank batches, slow interconnect). The first
`--warmup` steps are every optimizer's warm-up (freeze_step, var_freeze_step, PowerSGD start_step);
the table reports the median of the steps after it: wall time, and rank 0's CPU time (on a shared
machine the CPU column shows what a step costs when other jobs inflate the wall column; `--rounds`
interleaves repeated runs). 0/1 Adam takes up to 4 local steps between 1-bit synchronisations
(local_step_scaler 2, local_step_clipper 4).
Bytes are what this rank handed to the collectives (`engine.comm` accounting) per step, as volume
(an all-reduce of B bytes counts 2B). "veth" needs root: it creates namespaces dsb0/dsb1, a veth pair
10.77.0.1 <-> 10.77.0.2 with a tbf qdisc at `--rate` on both ends, and always deletes them again.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

NAMESPACES = ("dsb0", "dsb1")
DEVICES = ("dsb-v0", "dsb-v1")
ADDRESSES = ("10.77.0.1", "10.77.0.2")
LR = 1e-4


def _system_config(system: str, warmup: int, micro: int) -> dict:
    optimizer = {"type": "Adam", "params": {"lr": LR}}
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_clipping": 0.0,
           "zero_optimization": {"stage": 0, "reduce_bucket_size": 25_000_000}}
    if system == "OneBitAdam":
        optimizer = {"type": "OneBitAdam", "params": {"lr": LR, "freeze_step": warmup}}
    elif system == "ZeroOneAdam":
        optimizer = {"type": "ZeroOneAdam", "params": {"lr": LR, "var_freeze_step": warmup, "local_step_scaler": 2,
                                                       "local_step_clipper": 4}}
    elif system == "PowerSGD":
        cfg["gradient_compression"] = {"type": "powersgd", "rank": 4, "start_step": warmup}
    elif system != "Adam":
        raise SystemExit(f"unknown system {system!r}; use Adam, OneBitAdam, ZeroOneAdam, PowerSGD")
    cfg["optimizer"] = optimizer
    return cfg


def worker(args) -> None:
    """One rank: train `steps` steps, print one JSON line with per-step times and volumes."""
    import torch

    import engine
    from examples.gpt import BENCH_CONFIG, GPT, RandomTokens
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = _system_config(args.system, args.warmup, args.micro)
    eng, _, _, _ = engine.initialize(model=GPT(BENCH_CONFIG), config=cfg)
    rank = eng.comm.rank
    data = RandomTokens(args.steps * args.micro, args.seq, BENCH_CONFIG.vocab_size, seed=rank)
    times, cpu, volumes = [], [], []
    for step in range(args.steps):
        x, y = data[step * args.micro:(step + 1) * args.micro]
        eng.comm.stats.reset()
        start, start_cpu = time.perf_counter(), time.process_time()
        eng.backward(eng(x, y))
        eng.step()
        times.append((time.perf_counter() - start) * 1e3)
        cpu.append((time.process_time() - start_cpu) * 1e3)
        volumes.append(eng.comm.stats.volume())
    if rank == 0:
        print(json.dumps({"times": times, "cpu": cpu, "volumes": volumes}), flush=True)
    torch.distributed.destroy_process_group()


def _sh(*cmd: str, check: bool = True) -> None:
    subprocess.run(cmd, check=check, capture_output=True, text=True, timeout=30)


def setup_link(rate: str) -> None:
    cleanup_link()
    for ns in NAMESPACES:
        _sh("ip", "netns", "add", ns)
    _sh("ip", "link", "add", DEVICES[0], "type", "veth", "peer", "name", DEVICES[1])
    for ns, dev, addr in zip(NAMESPACES, DEVICES, ADDRESSES):
        _sh("ip", "link", "set", dev, "netns", ns)
        _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
        _sh("ip", "-n", ns, "link", "set", dev, "up")
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
        # burst >= rate/HZ so the bucket can reach the rate; latency bounds the queue.
        _sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", "1mb", "latency", "50ms")


def cleanup_link() -> None:
    for ns in NAMESPACES:  # deleting a namespace deletes its end of the veth pair (and the pair)
        _sh("ip", "netns", "del", ns, check=False)


def _run_pair(system: str, link: str, args) -> dict:
    port = str(29500 + os.getpid() % 1000)
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
               "MASTER_PORT": port, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        cmd = [sys.executable, __file__, "--worker", "--system", system, "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--micro", str(args.micro), "--seq", str(args.seq)]
        if link == "veth":
            env.update(MASTER_ADDR=ADDRESSES[0], GLOO_SOCKET_IFNAME=DEVICES[rank])
            cmd = ["ip", "netns", "exec", NAMESPACES[rank]] + cmd
        else:
            env.update(MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo")
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        out, err = procs[0].communicate(timeout=args.timeout)
        procs[1].wait(timeout=30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if procs[0].returncode != 0:
        raise RuntimeError(f"{system} on {link} failed:\n{err[-3000:]}")
    return json.loads(out.strip().splitlines()[-1])


def _summary(rows: list[dict], warmup: int) -> dict:
    """Medians over the steps of all rounds (warm-up: steps 1..warmup-1; after: from warmup+1 on)."""
    after = slice(warmup + 1, None)  # the first compressed step also builds buffers

    def pooled(key, part):
        return [v for row in rows for v in row[key][part]]
    return {"warm_ms": statistics.median(pooled("times", slice(1, warmup))),
            "ms": statistics.median(pooled("times", after)), "cpu_ms": statistics.median(pooled("cpu", after)),
            "warm_mb": statistics.median(pooled("volumes", slice(0, warmup))) / 1e6,
            "mb": statistics.mean(pooled("volumes", after)) / 1e6}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default="Adam,OneBitAdam,ZeroOneAdam,PowerSGD")
    p.add_argument("--links", default="loopback,veth")
    p.add_argument("--rate", default="1gbit", help="tc tbf rate of the veth link")
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--micro", type=int, default=1)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--rounds", type=int, default=1,
                   help="run every system this many times, interleaved; medians over all rounds' steps")
    p.add_argument("--timeout", type=float, default=600, help="seconds per system and link")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--system", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    links, systems = args.links.split(","), args.systems.split(",")
    if "veth" in links and os.geteuid() != 0:
        raise SystemExit("--links veth needs root (network namespaces and tc); run as root or use --links loopback")
    print(f"2 ranks x 1 thread, GPT 25.12M params fp32, micro-batch {args.micro} x {args.seq} tokens, "
          f"{args.warmup} warm-up steps, {args.steps} steps, {args.rounds} round(s); veth rate {args.rate}; "
          f"load average before: {os.getloadavg()[0]:.2f}")
    print("| link | system | MB/step warm-up | MB/step after | ms/step warm-up | ms/step after | CPU ms/step after "
          "| speed-up vs Adam |")
    print("|---|---|---|---|---|---|---|---|")
    for link in links:
        if link == "veth":
            setup_link(args.rate)
        try:
            runs: dict[str, list] = {s: [] for s in systems}
            for _ in range(args.rounds):
                for s in systems:
                    runs[s].append(_run_pair(s, link, args))
        finally:
            if link == "veth":
                cleanup_link()
        results = {s: _summary(rows, args.warmup) for s, rows in runs.items()}
        base = results.get("Adam", next(iter(results.values())))["ms"]
        for s, r in results.items():
            print(f"| {link} | {s} | {r['warm_mb']:.1f} | {r['mb']:.2f} | {r['warm_ms']:.0f} | {r['ms']:.0f} | "
                  f"{r['cpu_ms']:.0f} | {base / r['ms']:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
