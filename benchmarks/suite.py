"""The side-by-side benchmark suite: every built dstrain strategy against torch DDP, torch FSDP2 and
DeepSpeed with the same config, on the benchmark GPT and 2 ranks, in one run on this machine.

    python -m benchmarks.suite                          # full: the 25M benchmark GPT, 2 rounds (~21 min idle)
    python -m benchmarks.suite --model suite            # the same rows on a 0.7M GPT (~5 min): per-step costs
    python -m benchmarks.suite --quick --no-deepspeed                   # tiny GPT, few steps (a test runs it)

DeepSpeed runs from its own virtual environment, `--deepspeed-venv PATH` or by default one under the
user's cache directory, which the suite makes when it is missing (benchmarks/deepspeed_venv.py:
DeepSpeed 0.19.x, exactly our torch build, its CPU Adam op built); `--no-deepspeed` leaves it out.

Writes `benchmarks/results/<date>-<machine>.md` (or `--out-dir`) and PNG plots next to it. Every system
runs with the same model, data, seeds and threads (1 per rank) and 16 sequences per optimizer step;
rounds are interleaved (round 1: every system, round 2: every system, ...), so a noisy neighbour hurts
all systems alike. Columns:

- step ms: the median over rounds of the slowest rank's median step time after the warm-up steps;
  spread: the lowest and highest round. A round whose 1-minute load average, read just before it
  started, was above `--load-threshold` (default: the number of CPUs) is marked †.
- vs DDP / vs FSDP2 / vs DeepSpeed: step-time ratios to those peers from the same run; "vs DeepSpeed"
  compares with DeepSpeed running the same config.
- vs bound: the ratio to the no-communication bound: one rank's forward, backward and AdamW step on
  its own micro-batch, alone (world size 1), with the same threads.
- peak RSS/rank; the ZeRO paper's model-state memory (fp32 AdamW: params 4Ψ + grads 4Ψ + moments 8Ψ;
  bf16/fp16: 2Ψ + 2Ψ + 12Ψ of fp32 master weights and moments; partitioned by stage over the data
  axis) next to the measured RSS; for a pipeline or tensor-parallel row Ψ is the largest share one
  rank holds of the model (its stage, its shards), as dstrain's ranks report it.
- bytes/step/rank: one convention for every system, the bytes one rank sends per optimizer step,
  computed from each collective's payload and its group's size n with the ring/tree formula
  (benchmarks/comm_bytes.py's table): all-reduce of S bytes 2(n−1)/n·S, reduce-scatter of a full S
  and all-gather into a full S (n−1)/n·S each, reduce and broadcast (n−1)/n·S averaged over the group,
  a send S. So DDP and ZeRO-1/2 send the same Ψ·4·2(n−1)/n bytes of fp32 gradients-and-parameters, the
  ZeRO paper's equal volume. The payloads are counted where each system's collectives pass, as
  `suite_runners.COUNTED_BY` says (the report repeats it): dstrain's communicator, DDP's comm hook and
  DeepSpeed's comms_logger (its all-gathers log the input shard: converted) over every step; a
  dispatch mode for FSDP2 and the model-parallel rows, in the last warm-up step only (it intercepts
  every tensor op, so no measured step runs under it).
- scaling: step time and peak RSS per rank of `--scaling-system` against model size (3 sizes) and
  world size (`--worlds`, default 1, 2, 4).

Each round runs in one spawn per world size (its ranks run every system in turn) and one DeepSpeed
peer call: on a shared 2-core machine a spawn (torch, gloo, DeepSpeed's import) costs more than a small
model's steps, and ~30 spawns per round would not fit 15 minutes. Peak RSS per system is the kernel's
peak mark restarted before it (benchmarks/peak_rss.py), so it includes the interpreter, torch and what
earlier systems left on the heap. `--quick` is one round of a 0.02M GPT: it checks the code path.

A peer or strategy that cannot run is reported "not run: why" (the error's last line; for a DeepSpeed failure
that suite_strategies.DEEPSPEED_KNOWN_ERRORS knows as DeepSpeed's own behaviour, that reason with it), never faked.
A strategy is one row of STRATEGIES: a name and the config it runs; DeepSpeed gets the same config.
A strategy that needs another world size (pipe 2 x tensor 2, pipe 2 x data 2: 4 ranks, STRATEGY_WORLD)
runs in that world's spawn and DeepSpeed peer call, with the same 16 sequences per step, and its label
says how many ranks it ran on.
"""
from __future__ import annotations

import argparse
import copy
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import bench_training as bt  # noqa: E402
from benchmarks import deepspeed_venv, suite_plots  # noqa: E402
from benchmarks.report import command_line, header_lines, load_note, md_table, ratio_cell, step_cells  # noqa: E402
from benchmarks.suite_runners import COUNTED_BY, nvme_dir, rank_batch  # noqa: E402
from benchmarks.deepspeed_gpt_autotp import GPT_AUTOTP_LAYERS  # noqa: E402
from examples.gpt import BENCH_CONFIG, GPT, GPTConfig, count_parameters  # noqa: E402
from tests.harness import RankFailed, run_distributed  # noqa: E402

from benchmarks.suite_strategies import (DEEPSPEED_CAVEATS, DEEPSPEED_KNOWN_ERRORS, NO_DEEPSPEED,  # noqa: E402
                                         NO_TORCH_EQUIVALENT, STRATEGIES, STRATEGY_WORLD, TORCH_PEERS)
QUICK_MODEL = GPTConfig(vocab_size=256, seq_len=32, n_layer=1, n_head=2, d_model=32)
# The benchmark GPT (25M, the peers' baselines in shared/reference/baselines.md) is the default: the whole
# suite, 2 rounds of every row, took 21 minutes on the idle 2-core machine (2026-12-06). `--model suite`,
# a 0.7M GPT, runs the same rows in ~5 minutes, where fixed per-step costs dominate the step.
SUITE_MODEL = GPTConfig(vocab_size=2048, seq_len=64, n_layer=2, n_head=4, d_model=128)
MODELS = {"suite": SUITE_MODEL, "bench": BENCH_CONFIG}
DEEPSPEED_TIMEOUT_S = 1800  # one round's DeepSpeed peer call, every row of it


@dataclass
class Round:
    step_ms: float | None = None
    rss_mb: float | None = None
    bytes_per_step: float | None = None
    load_before: float = 0.0
    error: str | None = None
    uncounted_ops: tuple = ()  # a peer's ops its record has no conversion rule for (comm_bytes.py)
    model_share: int | None = None  # dstrain: Ψ of the largest model-parallel share (suite_runners.py)
    data_world: int | None = None  # dstrain: the data axis ZeRO partitions that share over


@dataclass
class Result:
    rounds: list[Round] = field(default_factory=list)

    def ok(self) -> list[Round]:
        return [r for r in self.rounds if r.error is None]

    @property
    def error(self) -> str | None:
        return None if self.ok() else (self.rounds[0].error if self.rounds else "not run")

    def step_ms(self) -> float | None:
        ok = self.ok()
        return statistics.median(r.step_ms for r in ok) if ok else None


def world_of(system: str, world: int) -> int:
    """The ranks `system` runs on: 1 for the bound, STRATEGY_WORLD's for a strategy listed there."""
    return 1 if system == "bound" else STRATEGY_WORLD.get(system, world)


def strategy_config(name: str, micro: int) -> dict:
    overrides, _ = STRATEGIES[name]
    cfg = bt._dstrain_config(0, True, json.loads(json.dumps(overrides).replace("NVME_DIR", nvme_dir())))
    cfg["train_micro_batch_size_per_gpu"] = overrides.get("train_micro_batch_size_per_gpu", micro)
    return cfg


def deepspeed_config(cfg: dict) -> dict:
    """The same config for DeepSpeed: torch's AdamW (`torch_adam`) instead of dstrain's `fused` flag, or,
    with optimizer offload, DeepSpeed's CPU Adam (it refuses a torch optimizer there); its comms_logger on."""
    cfg = copy.deepcopy(cfg)
    params = cfg["optimizer"].setdefault("params", {})
    params.pop("fused", None)
    offload = cfg.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none") != "none"
    if cfg["optimizer"]["type"] == "AdamW" and not offload:
        params["torch_adam"] = True
    if "tensor_parallel" in cfg and "pipeline" not in cfg:
        cfg["tensor_parallel"]["partition_config"] = GPT_AUTOTP_LAYERS
    cfg["comms_logger"] = {"enabled": True, "verbose": False, "prof_all": True}
    return cfg


def zero_formula_mb(n_params: int, stage: int, world: int, mixed: bool = False) -> float:
    """Model states per rank with AdamW: fp32 params 4Ψ + grads 4Ψ + moments 8Ψ; mixed precision (ZeRO paper
    §3.1): 16-bit params 2Ψ + grads 2Ψ + K = 12 bytes of fp32 master weights and moments per parameter."""
    p, g, o = (2.0 * n_params, 2.0 * n_params, 12.0 * n_params) if mixed else \
        (4.0 * n_params, 4.0 * n_params, 8.0 * n_params)
    shares = {0: p + g + o, 1: p + g + o / world, 2: p + (g + o) / world, 3: (p + g + o) / world}
    return shares[stage] / 2**20


def _last_line(text: str) -> str:
    """An error's last line without its exception's module path ("ConfigError: pipeline.stages: ...")."""
    lines = [ln.strip() for ln in str(text).strip().splitlines() if ln.strip()]
    last = lines[-1] if lines else "failed"
    head, sep, rest = last.partition(": ")
    if sep and "." in head and " " not in head:
        last = f"{head.rsplit('.', 1)[-1]}: {rest}"
    return last[:200]


def measure_batch(points: list[tuple[str, int, GPTConfig]], steps: int, micro: int, warmup: int) -> dict:
    """dstrain's and torch's points, {(system, world, model): Round}: one spawn per world size, its ranks
    running the points in turn (suite_runners.rank_batch: a spawn costs more than a small model's steps)."""
    out = {}
    for world in sorted({w for _, w, _ in points}):
        here = [(s, m) for s, w, m in points if w == world]
        load = os.getloadavg()[0]
        items = [(s, asdict(m), strategy_config(s, micro) if s in STRATEGIES else None) for s, m in here]
        try:
            per_rank = run_distributed(rank_batch, world, args=(items, steps, micro, warmup), timeout=1800)
        except RankFailed as e:
            out.update({(s, world, m): Round(load_before=load, error=_last_line(e)) for s, m in here})
            continue
        out.update({(s, world, m): _round([rows[i] for rows in per_rank], load) for i, (s, m) in enumerate(here)})
    return out


def _round(per_rank: list[dict], load: float) -> Round:
    errors = [r["error"] for r in per_rank if "error" in r]
    if errors:
        return Round(load_before=load, error=_last_line(errors[0]))
    sent = [r["bytes"] for r in per_rank if r["bytes"] is not None]
    share = [r["model_share"] for r in per_rank if r.get("model_share") is not None]
    return Round(max(r["step_ms"] for r in per_rank), max(r["rss_mb"] for r in per_rank),
                 max(sent) if sent else None, load, model_share=max(share) if share else None,
                 data_world=per_rank[0].get("data_world"))


def measure_deepspeed(systems: list[str], results: dict, world: int, steps: int, model: GPTConfig, micro: int,
                      ds_python: Path | None, ds_missing: str) -> dict[str, Round]:
    """The "deepspeed:<strategy>" rows, {system: Round}: the runnable ones in one DeepSpeed peer call per
    world size (a strategy of STRATEGY_WORLD runs on its own ranks there too), the AutoTP rows in another."""
    load = os.getloadavg()[0]
    out, items = {}, {}
    for system in systems:
        base = system.split(":", 1)[1]
        if results[base].error:
            out[system] = Round(load_before=load, error="dstrain's row did not run: nothing to compare")
        elif base in NO_DEEPSPEED:
            out[system] = Round(load_before=load, error=NO_DEEPSPEED[base])
        elif ds_python is None:
            out[system] = Round(load_before=load, error=ds_missing)
        else:
            cfg = deepspeed_config(strategy_config(base, micro))
            # AutoTP rows in a call of their own: DeepSpeed's AutoTP leaves its model-parallel groups set in
            # the process, and a later engine there fails (seen: ZeRO-3 CPU offload, bf16 and fp16 after the
            # tp2 rows raised "'NoneType' object has no attribute 'get_model_parallel_rank'")
            items.setdefault((world_of(base, world), "tensor_parallel" in cfg), []).append(
                (system, {"model": asdict(model), "config": cfg}))
    for (ranks, _), batch in sorted(items.items()):
        out.update(_deepspeed_peer_call(batch, ranks, steps, ds_python, load))
    return out


def _deepspeed_peer_call(items: list[tuple[str, dict]], world: int, steps: int, ds_python: Path,
                         load: float) -> dict[str, Round]:
    """One benchmarks/deepspeed_peer.py --batch-json call on `world` ranks: {system: Round}."""
    # Pipeline rows last: a DeepSpeed PipelineModule leaves its model-parallel groups in deepspeed.utils.groups,
    # and a later engine of the same process then fails (seen: ZeRO-3 + NVMe after the pipe2 row raised
    # "'NoneType' object has no attribute 'get_model_parallel_rank'").
    items = sorted(items, key=lambda item: "pipeline" in item[1]["config"])
    cmd = [str(ds_python), str(bt.PEER), "--stage", "0", "--steps", str(steps), "--world", str(world),
           "--batch-json", json.dumps([item for _, item in items])]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=DEEPSPEED_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        why = (f"DeepSpeed peer did not finish in {DEEPSPEED_TIMEOUT_S} s (a JIT op build waiting on a "
               "stale lock in its torch_extensions cache hangs this way)")
        return {system: Round(load_before=load, error=why) for system, _ in items}
    if done.returncode:
        why = _last_line(f"DeepSpeed peer failed (exit {done.returncode}): {done.stderr[-2000:]}")
        return {system: Round(load_before=load, error=why) for system, _ in items}
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    return {system: Round(load_before=load, error=deepspeed_error(system, row["error"])) if "error" in row
            else Round(row["step_ms"], row["rss_mb"], row.get("bytes"), load,
                       uncounted_ops=tuple(row.get("uncounted_ops", ())))
            for (system, _), row in zip(items, rows)}


def deepspeed_error(system: str, error: str) -> str:
    """A DeepSpeed row's error as its cell says it: why, where DEEPSPEED_KNOWN_ERRORS knows it as DeepSpeed's own
    behaviour on the strategy's config (with DeepSpeed's message), else the error's last line."""
    last = _last_line(error)
    for text, why in DEEPSPEED_KNOWN_ERRORS.get(system.split(":", 1)[-1], ()):
        if text in last:
            return f"{why} ({last})"
    return last


# -- the report -------------------------------------------------------------------------------------
def _ms(result: Result, threshold: float) -> tuple[str, str]:
    ok = result.ok()
    if not ok:
        return f"not run: {result.error}", "not run"
    marked = any(r.load_before > threshold for r in ok)
    times = [r.step_ms for r in ok]
    return step_cells(result.step_ms(), min(times), max(times), len(ok), "round", marked)


def _ratio(a: Result, b: Result | None, label: str) -> str:
    if b is None:
        return f"n/a: {label}"
    error = b.error if b.error is None or b.error.startswith(label) else f"{label}: {b.error}"
    return ratio_cell(a.step_ms(), b.step_ms(), error)


def _formula_cell(n_params: int, stage: int, world: int, model_parallel: Result | None, mixed: bool) -> str:
    """The ZeRO formula's MB; for a model-parallel row (`model_parallel`: dstrain's row of that config) the
    formula of its largest model-parallel share Ψ_mp (a pipeline stage, a tensor shard) over its data axis."""
    if model_parallel is not None:
        shares = [(r.model_share, r.data_world) for r in model_parallel.ok() if r.model_share is not None]
        if not shares:
            return "not run: dstrain's row reported no model-parallel share"
        n_params, world = shares[0]
    mb = zero_formula_mb(n_params, stage, world, mixed)
    return f"{mb:.0f}" if mb >= 10 else f"{mb:.2f}"


def main_table(results: dict[str, Result], n_params: int, world: int, threshold: float) -> str:
    rows = []
    bound = results["bound"]
    for name, result in results.items():
        if name == "bound":
            continue
        base = name.split(":", 1)[-1]
        stage = STRATEGIES[base][1] if base in STRATEGIES else TORCH_PEERS[base]
        ms, spread = _ms(result, threshold)
        ds = results.get(f"deepspeed:{name}") if name in STRATEGIES else None
        ok = result.ok()
        rss = f"{max(r.rss_mb for r in ok):.0f}" if ok else "not run"
        sent = [r.bytes_per_step for r in ok if r.bytes_per_step is not None]
        uncounted = sorted({op for r in ok for op in r.uncounted_ops})
        sent = f"{max(sent) / 2**20:.3f} MiB" if sent else ("not run" if not ok else "not counted: " + (
            f"no conversion rule for {', '.join(uncounted)}" if uncounted else "no counter reported"))
        mixed = base in STRATEGIES and any(key in STRATEGIES[base][0] for key in ("bf16", "fp16"))
        formula = _formula_cell(n_params, stage, world, results.get(base) if base in NO_TORCH_EQUIVALENT else None,
                                mixed)
        label = f"deepspeed ({base}'s config)" if name.startswith("deepspeed:") else name
        if world_of(base, world) != world:
            label += f" ({world_of(base, world)} ranks)"
        torch_cells = [_ratio(result, results.get(p), p) for p in ("ddp", "fsdp2")]
        if base in NO_TORCH_EQUIVALENT:
            torch_cells = [f"n/a: {p} has no {NO_TORCH_EQUIVALENT[base]}" for p in ("DDP", "FSDP2")]
        rows.append((label, ms, spread, *torch_cells, _ratio(result, ds, "is a peer" if ds is None else "DeepSpeed"),
                     _ratio(result, bound, "bound"), rss, formula, sent))
    return md_table(("system", "step ms", "spread (rounds)", "vs DDP", "vs FSDP2", "vs DeepSpeed (same config)",
                     "vs no-comm bound", "peak RSS/rank MB", "ZeRO formula MB (model states)", "bytes/step/rank"),
                    rows)


def _scaling_rows(scaling: dict, system: str) -> str:
    rows = []
    for key, label in (("size", "parameters (M)"), ("world", "world size")):
        for x, r in scaling[key]:
            cells = (f"{r.step_ms:.1f}", f"{r.rss_mb:.0f}") if r.error is None else (f"not run: {r.error}",) * 2
            rows.append((f"{label} = {x}", *cells))
    return md_table((f"{system}", "step ms", "peak RSS/rank MB"), rows)


def deepspeed_version(python: Path) -> str:
    """DeepSpeed's version in its venv, and that venv's torch (the same build as ours: deepspeed_venv.py)."""
    out = subprocess.run([str(python), "-c", "import deepspeed, torch; print(deepspeed.__version__, torch.__version__)"],
                         capture_output=True, text=True, timeout=300)
    # DeepSpeed prints an accelerator warning on stdout before the version: keep the last line.
    lines = out.stdout.strip().splitlines()
    if not lines:
        return f"unknown ({_last_line(out.stderr)})"
    version, _, its_torch = lines[-1].strip().partition(" ")
    return f"{version} (its own venv {python.parent.parent}, torch {its_torch})"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny GPT, 4 steps, 1 round: checks the suite runs")
    p.add_argument("--systems", default=None,
                   help=f"comma-separated subset of {', '.join(['ddp', 'fsdp2', *STRATEGIES])} (default: all)")
    p.add_argument("--model", choices=sorted(MODELS), default="bench",
                   help="bench: the 25M benchmark GPT (default); suite: a 0.7M GPT (--quick: a 0.02M one)")
    p.add_argument("--steps", type=int, default=None, help="steps per measurement (default 8; quick 4)")
    p.add_argument("--warmup", type=int, default=None, help="steps left out of the median (default 2: the byte count's step, the "
                   "second, is past the first step's one-time traffic)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 2; quick 1)")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--worlds", default="1,2,4", help="world sizes of the scaling table")
    p.add_argument("--scaling-system", default="dstrain-z2")
    p.add_argument("--load-threshold", type=float, default=float(os.cpu_count() or 1),
                   help="mark a round whose 1-minute load average before it was above this (default: CPUs)")
    p.add_argument("--deepspeed-venv", type=Path, default=None,
                   help="DeepSpeed's own virtual environment, made when missing (benchmarks/deepspeed_venv.py; "
                        f"default {deepspeed_venv.default_path()})")
    p.add_argument("--no-deepspeed", action="store_true", help="no DeepSpeed rows: each says \"not run\" and why")
    p.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    args = p.parse_args(argv)
    args.steps = args.steps or (4 if args.quick else 8)
    args.warmup = args.warmup if args.warmup is not None else 2
    args.rounds = args.rounds or (1 if args.quick else 2)
    known = ["ddp", "fsdp2", *STRATEGIES]
    args.systems = args.systems.split(",") if args.systems else known
    unknown = [s for s in args.systems if s not in known]
    if unknown:
        p.error(f"--systems: unknown {unknown}; choose from {known}")
    if args.warmup >= args.steps:
        p.error(f"--warmup {args.warmup} leaves no step of --steps {args.steps} to measure")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    model = QUICK_MODEL if args.quick else MODELS[args.model]
    micro = bt.MICRO
    load_before = os.getloadavg()
    ds_python, ds_missing = None, "--no-deepspeed given"
    if not args.no_deepspeed and any(s in STRATEGIES for s in args.systems):  # a DeepSpeed row to run
        try:
            ds_python = deepspeed_venv.ensure(args.deepspeed_venv or deepspeed_venv.default_path(),
                                              log=lambda line: print(line, flush=True))
        except deepspeed_venv.VenvError as e:
            ds_missing = f"DeepSpeed venv unusable: {_last_line(e)}"
    systems = ["bound", *args.systems]
    systems += [f"deepspeed:{s}" for s in args.systems if s in STRATEGIES]
    results = {s: Result() for s in systems}
    first_round = {}
    for rnd in range(args.rounds):
        # What could not run in round 1 (a config not built yet) will not run later either.
        todo = [s for s in systems if not (results[s].rounds and results[s].error)]
        points = [(s, world_of(s, args.world), model) for s in todo if ":" not in s]
        if rnd == 0:
            points += [(args.scaling_system, w, m) for m, w in _scaling_points(args, model)
                       if (args.scaling_system, w, m) not in points]
        measured = measure_batch(points, args.steps, micro, args.warmup)
        first_round = first_round or measured
        for system, world, m in points:
            if system in results and m == model and world == world_of(system, args.world):
                results[system].rounds.append(measured[(system, world, m)])
        deepspeed = measure_deepspeed([s for s in todo if ":" in s], results, args.world, args.steps, model, micro,
                                      ds_python, ds_missing)
        for system, r in deepspeed.items():
            results[system].rounds.append(r)
        for system in todo:
            r = results[system].rounds[-1]
            shown = f"{r.step_ms:.1f} ms" if r.error is None else f"not run: {r.error}"
            print(f"[suite] round {rnd + 1}/{args.rounds} {system}: {shown} (load before {r.load_before:.2f})",
                  flush=True)
    scaling = _scaling(args, model, first_round)
    load_after = os.getloadavg()
    return write_report(args, model, results, scaling, load_before, load_after, ds_python)


def _scaling_sizes(args, model: GPTConfig) -> list[GPTConfig]:
    return [replace(model, d_model=d) for d in
            ((16, 32, 64) if args.quick else (model.d_model // 2, model.d_model, model.d_model * 2))]


def _scaling_points(args, model: GPTConfig) -> list[tuple[GPTConfig, int]]:
    return [(cfg, args.world) for cfg in _scaling_sizes(args, model)] + \
        [(model, int(w)) for w in args.worlds.split(",")]


def _scaling(args, model: GPTConfig, first_round: dict) -> dict:
    sizes = _scaling_sizes(args, model)
    system = args.scaling_system

    def run(cfg: GPTConfig, world: int) -> Round:
        return first_round[(system, world, cfg)]  # measured with round 1's batch
    out = {"size": [(f"{count_parameters(GPT(cfg)) / 1e6:.2f}", run(cfg, args.world)) for cfg in sizes]}
    out["world"] = [(w, run(model, w)) for w in (int(x) for x in args.worlds.split(","))]
    return out


def write_report(args, model, results, scaling, load_before, load_after, ds_python) -> int:
    n_params = count_parameters(GPT(model))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{_dt.date.today().isoformat()}-{platform.node() or 'machine'}{'-quick' if args.quick else ''}"
    base = args.out_dir / stem
    versions = {"deepspeed": deepspeed_version(ds_python) if ds_python else "not installed"}
    marked = sum(r.load_before > args.load_threshold for res in results.values() for r in res.rounds)
    total = sum(len(res.rounds) for res in results.values())
    notes = [f"model: GPT {asdict(model)} ({n_params / 1e6:.2f}M parameters), micro-batch {bt.MICRO} per rank, "
             f"fp32, AdamW (torch's, fused), gradient_clipping 1.0, {args.world} ranks x 1 thread, gloo",
             f"{args.steps} steps per measurement, median after {args.warmup} warm-up steps, {args.rounds} "
             f"interleaved round(s); {load_note(args.load_threshold, marked, total)}"]
    bound_ms, bound_spread = _ms(results["bound"], args.load_threshold)
    notes.append(f"no-communication bound (the denominator of \"vs no-comm bound\"): one rank's forward, backward "
                 f"and step on its own micro-batch, alone, 1 thread: {bound_ms} ms ({bound_spread})")
    notes += [f"bytes/step/rank of {who}: {how}" for who, how in COUNTED_BY.items()]
    caveats = {}  # one line per caveat, naming every row it applies to
    for name, why in DEEPSPEED_CAVEATS.items():
        if results.get(f"deepspeed:{name}") and results[f"deepspeed:{name}"].ok():
            caveats.setdefault(why, []).append(f"{name}'s")
    notes += [f"deepspeed ({' and '.join(names)} config): {why}" for why, names in caveats.items()]
    plots = suite_plots.draw(base, results, scaling)
    lines = header_lines("dstrain benchmark suite", command_line(), load_before, load_after, versions, notes)
    lines += ["## Strategies and peers", "", main_table(results, n_params, args.world, args.load_threshold), "",
              f"## Scaling ({args.scaling_system}, one round each)", "", _scaling_rows(scaling, args.scaling_system),
              "", "## Plots", "", *[f"- {p}" if p.startswith("plots") else f"![{p}]({p})" for p in plots], ""]
    path = base.with_suffix(".md")
    path.write_text("\n".join(lines))
    print(f"[suite] wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
