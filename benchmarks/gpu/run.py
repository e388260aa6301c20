"""The one GPU script (issue 15): does dstrain run on an NVIDIA GPU, and how fast? One markdown report.

    python benchmarks/gpu/run.py --out benchmarks/results/gpu_h200.md    # one GPU, NCCL; < 8 minutes on an H200
    python benchmarks/gpu/run.py --cpu --out /tmp/gpu_checks_cpu.md      # the same checks on CPU/gloo (CI runs it)

1. Placement at world size 1 (NCCL there; a world-1 group still makes the communicator check every
   tensor's device, engine/comm.py's note): ZeRO stages 0-3 x fp32/bf16/fp16 train a small GPT; every
   parameter and fp32 partition must sit on the device; fp32 stages 1-3 must agree with stage 0. On a
   GPU each step after the first runs under `torch.cuda.set_sync_debug_mode("warn")`, and the report
   counts the host syncs per step and where they come from. Offload (benchmarks/gpu/offload_checks.py):
   optimizer offload to "cpu" and "nvme" at stages 1-3 and parameter offload (under
   `zero.Init(remote_device=...)`) at stage 3, fp32 and bf16, each equal bit for bit to the same stage
   without offload; the model on the device, the partition on the host, its flats and swap pools pinned
   on a GPU; host syncs counted as above. Long sequences (benchmarks/gpu/long_sequence_checks.py, one
   rank only): `SparseSelfAttention` (Fixed with key-padding and causal masks, BigBird; fp32, bf16)
   equal to dense attention masked by the layout, forward and backward, on the device; activation
   checkpointing (full, "selective_unpack", full with cpu_checkpointing; dropout on) equal bit for bit
   to no checkpointing, the saved block inputs pinned on the host with cpu_checkpointing on a GPU.
2. Checkpoints: save (sync and async) -> load into a fresh engine -> resume gives the same losses as
   training on; `zero.Init`, `GatheredParameters` (a modifier edit) and `save_16bit_model` at stage 3.
3. The same checks on 2 ranks over gloo (CUDA tensors on a GPU, `DSTRAIN_DEVICE=cuda`, as far as
   gloo supports CUDA collectives; the report says which failed and why).
4. Throughput in bf16: the 25M benchmark GPT and a ~1B GPT, plain torch (autocast), FSDP2 and dstrain
   stages 0 and 3 on the same device in the same run, and for the 25M GPT dstrain ZeRO-2 with the
   optimizer on the host and ZeRO-3 with optimizer and parameters on NVMe (the benchmark suite's tiers,
   swapping under the system temp dir): step time (median after warm-up, with its spread
   over the steps, † when the machine's load was above `--load-threshold`), the ratio to plain torch,
   tokens/s, MFU against the GPU's bf16 dense peak (6N + attention FLOPs per token), peak memory; a
   system that fails is "not run: why". `--cpu` runs a tiny GPT only (the code path, not a measurement).
The report's header and cells are the benchmark suite's (benchmarks/report.py).
The script exits non-zero when a check fails; the report is written either way.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import engine  # noqa: E402
from benchmarks.report import command_line, header_lines, load_note, md_table, ratio_cell, step_cells  # noqa: E402
from engine.profiling.mfu import transformer_train_flops_per_token  # noqa: E402
from engine.profiling.peaks import gpu_peak_tflops  # noqa: E402
from benchmarks.bench_training import _torch_step  # noqa: E402  (plain torch's step, as the CPU benchmark's)
from benchmarks.suite import zero_formula_mb  # noqa: E402
from benchmarks.suite_strategies import STRATEGIES  # noqa: E402
from engine.comm import Communicator  # noqa: E402
from engine.dist import init_distributed  # noqa: E402
from engine.utils import safe_get_full_fp32_param  # noqa: E402
from examples.gpt import BENCH_CONFIG, GPT, GPTConfig, count_parameters  # noqa: E402
from benchmarks.gpu.offload_checks import offload_cases  # noqa: E402
from benchmarks.gpu.long_sequence_checks import long_sequence_cases  # noqa: E402
from benchmarks.gpu.training import MICRO, PRECISIONS, STEPS, TINY, batches, check_config, train  # noqa: E402

ONE_B = GPTConfig(vocab_size=50_304, seq_len=1024, n_layer=20, n_head=16, d_model=2048)


# -- 1, 2: checks (each returns a detail string, raises on failure) ------------------------------
def _on_device(eng) -> None:
    dev = eng.device
    where = {p.device for p in eng.module.parameters()}
    zopt = eng.zero_optimizer
    if hasattr(zopt, "partition"):
        where |= {f.device for f in zopt.partition.flat.values()}
    if where != {dev}:
        raise AssertionError(f"parameters/partitions on {sorted(map(str, where))}, expected {dev}")


def check_stage(stage: int, precision: str, world: int = 1, rank: int = 0, syncs: dict | None = None) -> str:
    torch.manual_seed(0)
    eng, _, _, _ = engine.initialize(model=GPT(TINY), config=check_config(stage, precision))
    try:  # destroyed, so no check's device memory, hooks or groups outlive it into the throughput table
        return _check_stage(eng, stage, precision, rank, syncs)
    finally:
        eng.destroy()


def _check_stage(eng, stage: int, precision: str, rank: int, syncs: dict | None) -> str:
    _on_device(eng)
    losses, found = train(eng, batches(STEPS, TINY, MICRO, rank), count_syncs=syncs is not None)
    if not all(v == v and abs(v) < 1e4 for v in losses):
        raise AssertionError(f"losses {losses}")
    if syncs is not None:
        syncs[f"ZeRO-{stage} {precision}"] = found
    if precision == "fp32":
        full = {n: safe_get_full_fp32_param(p).cpu() for n, p in eng.module.named_parameters()}
        check_stage.fp32[stage] = full
        base = check_stage.fp32.get(0)
        if base is not None and stage:
            worst = max((full[n] - base[n]).abs().max().item() for n in base)
            if worst > 1e-5:
                raise AssertionError(f"stage {stage} differs from stage 0 by {worst:.2e}")
            return f"losses {losses[0]:.4f} -> {losses[-1]:.4f}; max |w - w(stage 0)| {worst:.1e}"
    return f"losses {losses[0]:.4f} -> {losses[-1]:.4f}"


check_stage.fp32 = {}


def check_resume(stage: int, root: str, async_save: bool, rank: int = 0) -> str:
    torch.manual_seed(0)
    cfg = check_config(stage, "fp32", {"checkpoint": {"async_save": async_save}})
    steps = batches(4, TINY, MICRO, rank)
    eng, _, _, _ = engine.initialize(model=GPT(TINY), config=cfg)
    train(eng, steps[:2])
    eng.save_checkpoint(root, tag="t")
    straight, _ = train(eng, steps[2:])
    eng.wait_for_checkpoint()
    torch.manual_seed(1)  # a different start: everything must come from the checkpoint
    fresh, _, _, _ = engine.initialize(model=GPT(TINY), config=cfg)
    fresh.load_checkpoint(root, tag="t")
    _on_device(fresh)
    resumed, _ = train(fresh, steps[2:])
    eng.destroy()
    fresh.destroy()
    if max(abs(a - b) for a, b in zip(straight, resumed)) > 1e-6:
        raise AssertionError(f"resumed losses {resumed} != {straight}")
    return f"losses after resume {[round(v, 5) for v in resumed]} (same as without)"


def check_zero_init(root: str, rank: int = 0) -> str:
    torch.manual_seed(0)
    cfg = check_config(3, "bf16")
    with engine.zero.Init(config=cfg):
        model = GPT(TINY)
    chunks = {p._z3_chunk.device for p in model.parameters() if hasattr(p, "_z3_chunk")}
    eng, _, _, _ = engine.initialize(model=model, config=cfg)
    if chunks != {eng.device}:
        raise AssertionError(f"zero.Init kept chunks on {chunks}, expected {eng.device}")
    _on_device(eng)
    with engine.zero.GatheredParameters(model.ln_f.weight, modifier_rank=0), torch.no_grad():
        if rank == 0:
            model.ln_f.weight.fill_(2.0)
    if not torch.all(safe_get_full_fp32_param(model.ln_f.weight) == 2.0):
        raise AssertionError("GatheredParameters(modifier_rank=0): the edit did not reach the partition")
    train(eng, batches(2, TINY, MICRO, rank))
    eng.save_16bit_model(root)
    eng.destroy()
    if rank == 0:
        state = torch.load(Path(root) / "pytorch_model.bin", weights_only=True)
        bad = [k for k, t in state.items() if t.device.type != "cpu" or t.numel() == 0]
        if bad or tuple(state["tok.weight"].shape) != (TINY.vocab_size, TINY.d_model):
            raise AssertionError(f"save_16bit_model: empty or device tensors {bad}")
    return "chunks on the device; modifier edit kept; save_16bit_model full and on the host"


def run_checks(world: int = 1, syncs: dict | None = None) -> list[tuple[str, str, str]]:
    """(check, PASS/FAIL, detail) for every check, on this rank."""
    # What torch and the engine allocated at import lives to the end: out of the collector's sight, so
    # the gc.collect() of each of the ~60 engine.destroy() calls walks only one check's objects (load 8:
    # 8.6 s of CPU over the 1-rank pass's 57 collects, 3.5 s after; tests/offload_runs.py does the same),
    # and again after each check, for what it imported or cached (idle, the 1-rank pass alone: 59 collects
    # walked 38-121 thousand objects in 5.64 s of its 15.8 s; ~1 thousand in 0.21 s of 8.6 after).
    gc.freeze()
    rank = dist.get_rank() if dist.is_initialized() else 0
    check_stage.fp32 = {}
    cases = [(f"ZeRO-{s} {p}", check_stage, (s, p, world, rank, syncs)) for p in PRECISIONS for s in range(4)]
    host = Communicator(device="cpu") if world > 1 else None
    tmp = tempfile.mkdtemp(prefix="dstrain-gpu-") if rank == 0 else None
    tmp = host.all_gather_object(tmp)[0] if world > 1 else tmp
    for s in (0, 1, 3):
        for async_save in (False, True):
            cases.append((f"resume ZeRO-{s} {'async' if async_save else 'sync'} save", check_resume,
                          (s, f"{tmp}/ck{s}{async_save}", async_save, rank)))
    cases.append(("zero.Init + GatheredParameters + save_16bit_model", check_zero_init, (f"{tmp}/16bit", rank)))
    cases += offload_cases(rank, syncs)
    cases += long_sequence_cases() if world == 1 else []  # nothing collective in them to repeat on 2 ranks
    rows = []
    for name, fn, args in cases:
        try:
            rows.append((name, "PASS", fn(*args)))
        except Exception as e:  # noqa: BLE001 - the report names every failure; the exit code says it
            rows.append((name, "FAIL", f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"))
        gc.freeze()  # what the check imported or cached stays too: the next check's collects skip it
    if world > 1:
        host.all_gather_object(None)  # every rank is done with the checkpoints before rank 0 removes them
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


def _multirank(gpu: bool) -> list[tuple[str, str, str]]:
    from tests.harness import RankFailed, run_distributed
    env = {"DSTRAIN_DEVICE": "cuda"} if gpu else {}
    try:
        per_rank = run_distributed(run_checks, 2, kwargs={"world": 2}, timeout=400, env=env)
    except RankFailed as e:
        return [("2 ranks, gloo", "FAIL", str(e).strip().splitlines()[-1][:300])]
    return [(f"2 ranks: {n}", r0 if r0 == r1 else "FAIL", d0) for (n, r0, d0), (_, r1, _) in zip(*per_rank)]


def _all_checks(gpu: bool, syncs: dict) -> list[tuple[str, str, str]]:
    """The checks on one rank, then on two. On CPU the 2-rank world runs beside this process's pass, in a
    thread that waits for it: its ranks spend much of their time waiting on each other's collectives,
    time this pass uses (2 shared cores at load 8: the whole --cpu run 89 -> 53 s). On a GPU one after the other:
    the ranks would share the device and its memory with this pass, and the sync counts with them."""
    if gpu:
        return run_checks(syncs=syncs) + _multirank(gpu)
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(max_workers=1) as pool:
        two = pool.submit(_multirank, gpu)
        return run_checks() + two.result()


# -- 4: throughput ------------------------------------------------------------------------------------
def _flops_per_token(cfg: GPTConfig, n_params: int) -> float:
    return transformer_train_flops_per_token(n_params, cfg.n_layer, cfg.n_head, cfg.d_model // cfg.n_head, cfg.seq_len)


def _timed(step, batches, dev) -> tuple[list[float], float]:
    """Step times (ms) after 2 warm-up steps, and peak memory (GiB; host RSS on CPU)."""
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    times = []
    for x, y in batches:
        x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        step(x, y)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        times.append((time.perf_counter() - t0) * 1e3)
    if dev.type == "cuda":
        peak = torch.cuda.max_memory_allocated(dev) / 2**30
    else:
        import resource
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return times[2:], peak


def _plain(cfg, dev):
    with torch.device(dev):  # built where it runs: a 1B model's init on the host takes seconds
        model = GPT(cfg)
    model.forward = torch.autocast(dev.type, dtype=torch.bfloat16)(model.forward)
    return _torch_step(model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev.type == "cuda"))


def _fsdp2(cfg, dev):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    with torch.device(dev):
        model = GPT(cfg)
    mesh = init_device_mesh(dev.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return _torch_step(model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev.type == "cuda"))


def _dstrain(stage: int, strategy: str | None = None):
    """dstrain's bf16 step at `stage`; with `strategy`, the offload tiers of that benchmark-suite strategy."""
    def build(cfg, dev):
        zero = {"stage": stage, "overlap_comm": True}
        config = {"train_micro_batch_size_per_gpu": _dstrain.micro, "gradient_accumulation_steps": 1,
                  "gradient_clipping": 1.0, "bf16": {"enabled": True}, "steps_per_print": 10**9,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "fused": dev.type == "cuda"}},
                  "zero_optimization": zero}
        swap = tempfile.TemporaryDirectory(prefix="dstrain-gpu-nvme-") if strategy else None
        try:
            if strategy:
                tiers, aio = _suite_tiers(strategy, swap.name)
                zero.update(tiers)
                config.update(aio)
            with torch.device(dev):
                model = GPT(cfg)
            eng, _, _, _ = engine.initialize(model=model, config=config)
        except BaseException:
            if swap is not None:
                swap.cleanup()
            raise

        def step(x, y):
            eng.backward(eng(x, y))
            eng.step()

        def close():  # the engine's swap files (if any), then the temporary directory they were in
            eng.destroy()
            swap.cleanup()
        if swap is not None:
            step.close = close
        return step
    return build


def _suite_tiers(strategy: str, nvme_path: str) -> tuple[dict, dict]:
    """The offload keys of a benchmark-suite strategy (benchmarks/suite_strategies.py), swapping under
    `nvme_path`: its zero_optimization offload sections and sub_group_size, and its aio section."""
    overrides = json.loads(json.dumps(STRATEGIES[strategy][0]).replace("NVME_DIR", nvme_path))
    zero = {k: v for k, v in overrides["zero_optimization"].items() if k.startswith("offload_") or k == "sub_group_size"}
    return zero, {k: v for k, v in overrides.items() if k == "aio"}


TORCH_SYSTEM = "torch (autocast bf16)"  # the peer of the "vs torch" column: first, so its row is there
SYSTEMS = {TORCH_SYSTEM: _plain, "FSDP2 (bf16)": _fsdp2, "dstrain ZeRO-0 bf16": _dstrain(0),
           "dstrain ZeRO-3 bf16": _dstrain(3)}
# GPU only, the 25M GPT only: the suite's tiers; pinned buffers and overlapped copies are what is measured.
OFFLOAD_SYSTEMS = {"dstrain ZeRO-2 bf16, optimizer on CPU": _dstrain(2, "dstrain-z2-offload-cpu"),
                   "dstrain ZeRO-3 bf16, optimizer and parameters on NVMe": _dstrain(3, "dstrain-z3-offload-nvme")}
# The suite's ZeRO-formula column (benchmarks/suite.py zero_formula_mb): (stage, mixed precision) per system.
# Autocast and FSDP2's policy keep fp32 parameters (4Ψ + 4Ψ + 8Ψ); dstrain's bf16 is 2Ψ + 2Ψ + 12Ψ. As in the
# suite, an offloaded row has its stage's formula: model states per rank, wherever the tier keeps them.
FORMULA = {TORCH_SYSTEM: (0, False), "FSDP2 (bf16)": (3, False), "dstrain ZeRO-0 bf16": (0, True),
           "dstrain ZeRO-3 bf16": (3, True), "dstrain ZeRO-2 bf16, optimizer on CPU": (2, True),
           "dstrain ZeRO-3 bf16, optimizer and parameters on NVMe": (3, True)}


THROUGHPUT_HEADER = ("model", "system", "step ms", "spread (steps)", "vs torch", "tokens/s", "MFU",
                     "ZeRO formula GiB (model states)", "peak GiB")


def run_throughput(models: list[tuple[str, GPTConfig, int, int, dict]], dev, peak_tflops: float | None,
                   threshold: float) -> tuple[list[tuple], int]:
    """The suite's cells (benchmarks/report.py) for each model x its systems; and how many were measured under load."""
    rows, loaded = [], 0
    for label, cfg, micro, steps, systems in models:
        _dstrain.micro = micro
        torch_ms = None
        for system, build in systems.items():
            torch.manual_seed(0)
            load = os.getloadavg()[0]
            step = None
            try:
                step = build(cfg, dev)
                n = _n_params(cfg)
                times, peak = _timed(step, batches(steps, cfg, micro), dev)
            except Exception as e:  # noqa: BLE001 - one system's failure is a row, not the end of the run
                why = f"not run: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
                rows.append((label, system, why, *["not run"] * (len(THROUGHPUT_HEADER) - 3)))
                continue
            finally:
                if hasattr(step, "close"):  # an offload row: its swap files and their directory
                    step.close()
                step = None  # the model and its optimizer go before the cache is emptied
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            ms = statistics.median(times)
            torch_ms = ms if system == TORCH_SYSTEM else torch_ms
            loaded += load > threshold
            tokens = micro * cfg.seq_len / (ms / 1e3)
            mfu = (f"{100 * tokens * _flops_per_token(cfg, n) / (peak_tflops * 1e12):.1f}%"
                   if peak_tflops else "n/a: no peak for this device")
            stage, mixed = FORMULA[system]
            formula = zero_formula_mb(n, stage, dist.get_world_size(), mixed) / 1024
            rows.append((label, system, *step_cells(ms, min(times), max(times), len(times), "step", load > threshold),
                         ratio_cell(ms, torch_ms, f"{TORCH_SYSTEM} did not run"), f"{tokens:,.0f}", mfu,
                         f"{formula:.3g}" if formula < 0.01 else f"{formula:.2f}", f"{peak:.2f}"))
    return rows, loaded


def _n_params(cfg: GPTConfig) -> int:
    with torch.device("meta"):
        return count_parameters(GPT(cfg))


# -- the report -----------------------------------------------------------------------------------------
def _table(header: tuple, rows: list) -> str:
    return md_table(header, [[str(c).replace("|", "/") for c in r] for r in rows])


def _syncs_table(syncs: dict) -> str:
    rows = []
    for case, found in syncs.items():
        where = {}
        for site in found:
            where[site] = where.get(site, 0) + 1
        per_step = len(found) / (STEPS - 1)
        rows.append((case, f"{per_step:g}",
                     ", ".join(f"{s} ({n // (STEPS - 1)}/step)" for s, n in sorted(where.items())) or "-"))
    return _table(("case", "host syncs per step", "where"), rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="run the same checks on CPU with gloo (CI)")
    parser.add_argument("--out", default=None, help="the markdown report (default: benchmarks/results/gpu_<gpu>.md)")
    parser.add_argument("--skip-throughput", action="store_true", help="checks only")
    parser.add_argument("--load-threshold", type=float, default=float(os.cpu_count() or 1),
                        help="mark a figure measured when the 1-minute load was above this (default: CPUs)")
    args = parser.parse_args(argv)
    gpu = not args.cpu
    if gpu and not torch.cuda.is_available():
        parser.error("no CUDA device visible: run on a GPU machine, or pass --cpu")
    init_distributed(dist_backend="nccl" if gpu else "gloo")
    dev = engine.dist.device()
    name = torch.cuda.get_device_name(dev) if gpu else "CPU"
    t0, load_before = time.perf_counter(), os.getloadavg()
    syncs: dict = {}
    checks = _all_checks(gpu, syncs)
    bench, loaded = [], 0
    if not args.skip_throughput:
        peak = gpu_peak_tflops(name) if gpu else None  # engine/profiling/peaks.py: dense bf16 table
        models = ([("25M GPT", BENCH_CONFIG, 8, 12, {**SYSTEMS, **OFFLOAD_SYSTEMS}), ("1B GPT", ONE_B, 8, 10, SYSTEMS)]
                  if gpu else [("tiny GPT (code path only)", TINY, 2, 4, SYSTEMS)])
        bench, loaded = run_throughput(models, dev, peak, args.load_threshold)
    failed = [c for c in checks if c[1] != "PASS"] + [b for b in bench if b[2].startswith("not run")]
    # The suite's header and cells (benchmarks/report.py): command, versions, machine, load, † marks.
    notes = [f"backend {dist.get_backend()}, device {dev}, {time.perf_counter() - t0:.0f} s, {len(failed)} failure(s)"]
    if bench:
        notes.append("throughput: median step after 2 warm-up steps, spread over the measured steps, 1 round; "
                     + load_note(args.load_threshold, loaded, len(bench)))
    report = header_lines(f"dstrain on {name}", command_line(), load_before, os.getloadavg(), {}, notes)
    report += ["## Checks", "", _table(("check", "result", "detail"), checks)]
    if gpu:
        report += ["", "## Host syncs per training step (world size 1, steps 2-4)", "", _syncs_table(syncs)]
    if bench:
        header = THROUGHPUT_HEADER if gpu else (*THROUGHPUT_HEADER[:-1], "peak RSS GiB")
        report += ["", "## Throughput (bf16, world size 1)", "", _table(header, bench)]
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"gpu_{name.split()[-1].lower()}.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(report) + "\n")
    print("\n".join(report))
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
