"""The optimizer set, measured three ways in one run (docs/optimizers.md has the figures).

    python benchmarks/bench_optimizers.py --part kernels --numel 1e8
    python benchmarks/bench_optimizers.py --part muon
    python benchmarks/bench_optimizers.py --part gpt --steps 8 --deepspeed-venv /tmp/ds-venv
    python benchmarks/bench_optimizers.py --part gpt --offload cpu --deepspeed-venv /tmp/ds-venv
    python benchmarks/bench_optimizers.py --part nvme --nvme-path /local_nvme --deepspeed-venv /tmp/ds-venv

- kernels: one optimizer step over `--numel` fp32 parameters (one flat tensor, as a ZeRO partition),
  each optimizer's median time against its memory-bandwidth bound: the bytes it must read and write
  per parameter (below) at the `add_` bandwidth measured in the same run (a.add_(b): 12 bytes/element).
  Lamb three ways: on a ZeRO flat (per-tensor runs), at stage 0 on one tensor, and at stage 0 on the
  same elements cut into 40,000 tensors (the batched step).
  Adagrad runs twice, torch's fused CPU kernel and its foreach kernel, to show which the offloaded
  step should use (ops.Adagrad picks fused).
- muon: Newton-Schulz time of the benchmark GPT's Muon matrices, owner-based (the most loaded rank's
  share under engine/zero/per_tensor.py's assignment) against redundant (every rank all of them).
- gpt: step time of each optimizer on the benchmark GPT (examples/gpt.py BENCH_CONFIG), 2 ranks, ZeRO-2,
  and DeepSpeed's same config in its venv where DeepSpeed can build that optimizer on CPU. With
  `--offload cpu` (or nvme, at `--nvme-path`) both sides offload the optimizer (`offload_optimizer`).
- nvme (short): the boundary step (`eng.step()`: optimizer step and all-gather) of AdamW, Lamb and Muon
  on a small MLP (`--width`, 4 layers), 2 ranks, ZeRO-2, with the optimizer in memory and on NVMe at
  `--nvme-path` (`--sub-group` elements per swapped sub-group): what the swap files cost each, and
  what Lamb's and Muon's second pass over them (engine/zero/nvme_per_tensor.py) costs on top of the
  one pass AdamW takes. With `--deepspeed-venv`, also the benchmark GPT's training step at ZeRO-3 with
  the optimizer on NVMe (DeepSpeed 0.19.8 swaps optimizer state to NVMe only at stage 3) for dstrain
  and DeepSpeed's same config, `--rounds` interleaved rounds (dstrain, DeepSpeed, dstrain, ...), the
  load average before and after; "not run: why" where DeepSpeed cannot build the optimizer on CPU.
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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ops  # noqa: E402
from engine.zero.per_tensor import assign_owners  # noqa: E402
from examples.gpt import BENCH_CONFIG, GPT  # noqa: E402
from ops.muon import muon_cost, orthogonalized  # noqa: E402

# fp32 bytes each step must move per parameter: reads + writes of weight, gradient and state.
BYTES_PER_PARAM = {
    "AdamW": 4 * (4 + 3),       # read w, g, m, v; write w, m, v
    "Adagrad": 4 * (3 + 2),     # read w, g, s; write w, s
    "Adagrad foreach": 4 * (3 + 2),
    "Lion": 4 * (3 + 2),        # read w, g, m; write w, m
    # ZeRO's flat and, at stage 0, a tensor over a block (ops/lamb.py blocks): pass 1 reads w, g, m, v and
    # writes m, v; pass 2 reads w, m, v and writes w (each row's tensor id: 1/8 byte per element, not counted)
    "Lamb": 4 * (4 + 2) + 4 * (3 + 1),
    "Lamb stage 0": 4 * (4 + 2) + 4 * (3 + 1),
    # stage 0, tensors smaller than a block: batches in cache, so one pass (read w, g, m, v; write w, m, v)
    "Lamb stage 0, 40,000 tensors": 4 * (4 + 3),
}
MANY_TENSORS = 40_000
CONFIGS = {  # the config's optimizer sections benchmarked on the GPT
    "AdamW": {"type": "AdamW", "params": {"lr": 1e-4}},
    "Adagrad": {"type": "Adagrad", "params": {"lr": 1e-2}},
    "Lion": {"type": "Lion", "params": {"lr": 1e-5}},
    "Lamb": {"type": "Lamb", "params": {"lr": 1e-3}},
    "Muon": {"type": "Muon", "params": {"lr": 1e-3}},
}
# What DeepSpeed 0.19.8 builds for each type on a CPU-only machine (DS_BUILD_OPS=0): FusedLion and
# FusedLamb are CUDA ops, so only these run there.
DEEPSPEED_ON_CPU = {"AdamW": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
                    "Adagrad": CONFIGS["Adagrad"], "Muon": CONFIGS["Muon"]}
# With the optimizer offloaded DeepSpeed steps on the host with its C++ ops (DeepSpeedCPUAdam,
# DeepSpeedCPUAdagrad, DeepSpeedCPULion), JIT-built on first use: only CPU Adam is built in the peer venv.
DEEPSPEED_OFFLOADED = {"AdamW": {"type": "AdamW", "params": {"lr": 1e-4}}}
# The nvme part's DeepSpeed column: its Muon goes through the same offload path (DeepSpeedCPUAdam for
# its AdamW half); its Lamb is FusedLamb, a CUDA op.
DEEPSPEED_NVME = {**DEEPSPEED_OFFLOADED, "Muon": CONFIGS["Muon"]}
DEEPSPEED_NOT_ON_CPU = {"Lamb": "not run: DeepSpeed 0.19.8's Lamb is FusedLamb, a CUDA op (no CPU build)"}
# DeepSpeed 0.19.8 refuses Muon with reduce_scatter (its default): "Muon and reduce scatter cannot be
# used together". Off for its Muon run only; it changes how gradients are reduced, not the update.
DEEPSPEED_NVME_ZERO = {"Muon": {"reduce_scatter": False}}


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up: state allocation, first-touch page faults
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _make(name: str, p: torch.Tensor) -> torch.optim.Optimizer:
    return {"AdamW": lambda: torch.optim.AdamW([p], lr=1e-4, fused=True),
            "Adagrad": lambda: ops.Adagrad([p], lr=1e-2, fused=True),
            "Adagrad foreach": lambda: ops.Adagrad([p], lr=1e-2, foreach=True),
            "Lion": lambda: ops.Lion([p], lr=1e-5),
            "Lamb": lambda: _flat_lamb(p),
            "Lamb stage 0": lambda: ops.Lamb([p], lr=1e-3),
            "Lamb stage 0, 40,000 tensors": lambda: _many_lamb(p, MANY_TENSORS)}[name]()


def _flat_lamb(p: torch.Tensor) -> torch.optim.Optimizer:
    """ops.Lamb over `p` as ZeRO hands it a partition: one flat, its elements' parameter ids (one
    parameter here), the per-parameter norms' reduction (one rank: the identity)."""
    from ops.tensor_segments import FlatRuns, SegmentedReduction
    opt = ops.Lamb([p], lr=1e-3)
    opt.segmented = SegmentedReduction({p: FlatRuns([(0, p.numel(), 0)], p.device, cache=True)}, 1, lambda v: v)
    return opt


def _many_lamb(p: torch.Tensor, count: int) -> torch.optim.Optimizer:
    """ops.Lamb at stage 0 over `p` cut into `count` tensors (views of it, and their gradients of its)."""
    params = [torch.nn.Parameter(t) for t in p.detach().chunk(count)]
    for q, g in zip(params, p.grad.chunk(count)):
        q.grad = g
    return ops.Lamb(params, lr=1e-3)


def kernels(numel: int, repeats: int) -> list[dict]:
    a = torch.randn(numel, dtype=torch.float32, device="cpu")
    b = torch.randn(numel, dtype=torch.float32, device="cpu")
    add_ms = _median_ms(lambda: a.add_(b), repeats)
    bandwidth = 12 * numel / (add_ms / 1e3)  # bytes/s
    del a, b
    rows = [{"kernel": "add_", "ms": add_ms, "GB/s": bandwidth / 1e9}]
    for name, nbytes in BYTES_PER_PARAM.items():
        p = torch.nn.Parameter(torch.randn(numel, dtype=torch.float32, device="cpu") * 0.02)
        p.grad = torch.randn(numel, dtype=torch.float32, device="cpu") * 1e-3
        opt = _make(name, p)
        ms = _median_ms(opt.step, repeats)
        bound = nbytes * numel / bandwidth * 1e3
        rows.append({"kernel": name, "ms": ms, "bound_ms": bound, "of_bound": bound / ms, "bytes/param": nbytes})
        del opt, p
    return rows


def muon_matrices() -> list[tuple[str, tuple[int, int]]]:
    """The benchmark GPT's Muon matrices (engine/optimizers.py's rule: >= 2 dims, no embed/lm_head)."""
    model = GPT(BENCH_CONFIG)
    return [(n, (p.shape[0], p[0].numel())) for n, p in model.named_parameters()
            if p.dim() >= 2 and not any(w in n.lower() for w in ("embed", "lm_head"))]


def muon(world: int, repeats: int) -> dict:
    shapes = [s for _, s in muon_matrices()]
    times = []
    for rows, cols in shapes:
        m = torch.randn(rows, cols, device="cpu")
        times.append(_median_ms(lambda m=m: orthogonalized(m), repeats))
    owners = assign_owners([muon_cost(r, c) for r, c in shapes], world)
    per_rank = [sum(t for t, o in zip(times, owners) if o == r) for r in range(world)]
    return {"matrices": len(shapes), "redundant_ms": sum(times), "owner_ms_per_rank": per_rank,
            "owner_max_ms": max(per_rank), "speedup": sum(times) / max(per_rank)}


def _offload_section(offload: str, nvme_path: str | None) -> dict:
    if offload == "none":
        return {}
    section = {"device": offload}
    if offload == "nvme":
        section["nvme_path"] = nvme_path
    return {"offload_optimizer": section}


def _gpt_rank(cfg: dict, steps: int, offload: dict, stage: int = 2) -> float:
    import torch.distributed as dist

    import engine
    from examples.gpt import RandomTokens
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "optimizer": cfg, "zero_optimization": {"stage": stage, "overlap_comm": True, "reduce_bucket_size": 5e6,
                                                      **offload}}
    eng, _, _, _ = engine.initialize(model=GPT(BENCH_CONFIG), config=config)
    data = RandomTokens(steps * 8, BENCH_CONFIG.seq_len, BENCH_CONFIG.vocab_size, seed=dist.get_rank())
    times = []
    for i in range(steps):
        x, y = data[i * 8:(i + 1) * 8]
        t0 = time.perf_counter()
        eng.backward(eng(x, y))
        eng.step()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[2:])


def _deepspeed_step_ms(venv: Path, cfg: dict, steps: int, section: dict, stage: int) -> float | str:
    """DeepSpeed's median step on the benchmark GPT (deepspeed_peer.py), or why it failed."""
    out = subprocess.run([str(venv / "bin" / "python"), str(Path(__file__).parent / "deepspeed_peer.py"),
                          "--stage", str(stage), "--steps", str(steps), "--world", "2", "--optimizer", json.dumps(cfg),
                          "--extra", json.dumps({"zero_optimization": section})],
                         capture_output=True, text=True, timeout=1800)
    if out.returncode == 0:
        return json.loads(out.stdout.strip().splitlines()[-1])["step_ms"]
    return f"failed: {(out.stderr.strip().splitlines() or ['no output'])[-1][:200]}"


def gpt(steps: int, venv: Path | None, names: list[str], offload: str = "none",
        nvme_path: str | None = None) -> list[dict]:
    from tests.harness import run_distributed
    rows, section = [], _offload_section(offload, nvme_path)
    for name in names:
        cfg = CONFIGS[name]
        row = {"optimizer": name, "offload": offload,
               "dstrain_ms": max(run_distributed(_gpt_rank, 2, args=(cfg, steps, section), timeout=1800))}
        peer = DEEPSPEED_ON_CPU if offload == "none" else DEEPSPEED_OFFLOADED
        if venv is not None and name in peer:
            row["deepspeed_ms"] = _deepspeed_step_ms(venv, peer[name], steps, section, 2)
        rows.append(row)
    return rows


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def nvme_gpt(steps: int, venv: Path, names: list[str], nvme_path: str, sub_group: int, rounds: int) -> dict:
    """The GPT at ZeRO-3 with the optimizer on NVMe, dstrain and DeepSpeed in interleaved rounds."""
    from tests.harness import run_distributed
    section = {"sub_group_size": sub_group, **_offload_section("nvme", nvme_path)}
    result = {"load_before": _load(), "rows": []}
    rows = {name: {"optimizer": name, "stage": 3, "dstrain_ms": [], "deepspeed_ms": []} for name in names}
    for _ in range(rounds):
        for name in names:
            rows[name]["dstrain_ms"].append(max(run_distributed(_gpt_rank, 2, args=(CONFIGS[name], steps, section, 3),
                                                                timeout=1800)))
            if name in DEEPSPEED_NVME:
                peer_section = {**section, **DEEPSPEED_NVME_ZERO.get(name, {})}
                rows[name]["deepspeed_ms"].append(_deepspeed_step_ms(venv, DEEPSPEED_NVME[name], steps, peer_section, 3))
            else:
                rows[name]["deepspeed_ms"] = DEEPSPEED_NOT_ON_CPU.get(name, "not run: no CPU build in DeepSpeed")
    for row in rows.values():
        times = row["deepspeed_ms"]
        if isinstance(times, list) and all(isinstance(t, float) for t in times):
            row["deepspeed_over_dstrain"] = statistics.median(times) / statistics.median(row["dstrain_ms"])
        result["rows"].append(row)
    result["load_after"] = _load()
    return result


class _MLP(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.layers = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)])

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.layers(x), y)


def _nvme_step_rank(cfg: dict, width: int, steps: int, zero: dict) -> float:
    import engine
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 16, "gradient_clipping": 0.0, "optimizer": cfg,
              "zero_optimization": {"stage": 2, **zero}}
    eng, _, _, _ = engine.initialize(model=_MLP(width), config=config)
    times = []
    for _ in range(steps):
        x = torch.randn(16, width, device="cpu")
        eng.backward(eng(x, x))
        t0 = time.perf_counter()
        eng.step()
        times.append((time.perf_counter() - t0) * 1e3)
    eng.destroy()  # removes the swap directory
    return statistics.median(times[2:])


def nvme_step(width: int, steps: int, sub_group: int, nvme_path: str, names: list[str]) -> list[dict]:
    from tests.harness import run_distributed
    rows = []
    for name in names:
        row = {"optimizer": name, "params": 4 * (width * width + width)}
        for where, zero in (("memory", {}), ("nvme", {"sub_group_size": sub_group, **_offload_section("nvme", nvme_path)})):
            row[f"{where}_step_ms"] = max(run_distributed(_nvme_step_rank, 2, args=(CONFIGS[name], width, steps, zero),
                                                          timeout=1800))
        row["nvme_over_memory"] = row["nvme_step_ms"] / row["memory_step_ms"]
        rows.append(row)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["kernels", "muon", "gpt", "nvme"], required=True)
    p.add_argument("--numel", type=float, default=1e8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--deepspeed-venv", type=Path, default=None)
    p.add_argument("--optimizers", default=",".join(CONFIGS), help="gpt part: which of " + ", ".join(CONFIGS))
    p.add_argument("--offload", choices=["none", "cpu", "nvme"], default="none",
                   help="gpt part: zero_optimization.offload_optimizer.device on both sides")
    p.add_argument("--nvme-path", default=None, help="gpt part with --offload nvme, nvme part: the swap directory")
    p.add_argument("--width", type=int, default=512, help="nvme part: the MLP's width")
    p.add_argument("--sub-group", type=int, default=65536, help="nvme part: zero_optimization.sub_group_size")
    p.add_argument("--rounds", type=int, default=2, help="nvme part with --deepspeed-venv: interleaved rounds")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.part == "kernels":
        result = kernels(int(args.numel), args.repeats)
    elif args.part == "muon":
        result = muon(args.world, args.repeats)
    elif args.part == "nvme":
        if args.nvme_path is None:
            p.error("--part nvme needs --nvme-path (a directory for the swap files)")
        names = args.optimizers.split(",") if args.optimizers != ",".join(CONFIGS) else ["AdamW", "Lamb", "Muon"]
        result = {"mlp_zero2": nvme_step(args.width, args.steps, args.sub_group, args.nvme_path, names)}
        if args.deepspeed_venv is not None:
            result["gpt_zero3"] = nvme_gpt(args.steps, args.deepspeed_venv, names, args.nvme_path, args.sub_group,
                                           args.rounds)
    else:
        result = gpt(args.steps, args.deepspeed_venv, args.optimizers.split(","), args.offload, args.nvme_path)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
