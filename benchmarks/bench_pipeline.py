"""Pipeline schedules side by side: dstrain's `train_batch` with every `pipeline.schedule`, torch's own
PipelineStage + schedule on the same layers, and (with --deepspeed-venv) DeepSpeed's PipelineEngine.

    python benchmarks/bench_pipeline.py --stages 2,4 --micro-batches 1,4,8 --steps 20 --rounds 3
    python benchmarks/bench_pipeline.py --stages 2 --micro-batches 4 --deepspeed-venv /tmp/ds-venv
    python benchmarks/bench_pipeline.py --stages 2 --micro-batches 4 --tensor-parallel 2   # 3D rows

Workload: benchmarks/pipe_workload.py (16 layers: 8 × Linear(512, 512) + GELU, micro-batch 16 or `--micro-size`, MSE,
SGD; `--width D` makes them Linear(D, D)), one rank per stage, 1 thread each, gloo over loopback, fp32. Per row: the median train_batch
time of the last min(15, N - 1) of N steps (the first builds the stages; the next warm up), the slowest
rank's, over `--rounds` interleaved rounds (in each, for every m, dstrain's schedules and torch's run
in one set of processes and DeepSpeed's right after, or right before in every other round), with the
ratio to DeepSpeed taken within each round and its median over rounds reported (a shared machine's
load drifts between rounds); the bubble fraction replayed from the executed actions
(engine/pipe/schedule.py, "replay") next to its formula and to the idle fraction each stage measured in
wall-clock time (engine/pipe/stage_clock.py: the share of the pipeline's span, the earliest start to the
latest end of the stages' schedule runs, spent outside forward, backward and loss; per stage, the median
over the measured steps, then over rounds), and the peak
bytes of activations autograd holds per stage (saved-tensor hooks). With more ranks than free cores
a stage also waits for a core, and that wait counts as idle: read 4-stage rows on 2 cores as a bound.
Interleaved and zero-bubble rows use 2 chunks per rank. These machines are shared and noisy: read
ratios, and the load printed with them.
`--timeline` prints, per rank, every action, wait and post of two dstrain-1f1b steps after `--steps`
warm-up ones (benchmarks/pipe_timeline.py; docs/parallelism.md reads one).
`--systems 1f1b,torch` runs only those (dstrain's schedules by name, "torch" for torch's bare one);
`--separate` starts each in processes of its own, as DeepSpeed's peer always is (by default dstrain's
schedules and torch's run one after another in one set, so each inherits the one before's heap and
threads).
`--paired` steps dstrain's 1f1b and torch's bare schedule alternately in the same processes, each step
from aligned ranks (an untimed barrier), and reports the median ratio of the step pairs and each rank's
median CPU time per step (process CPU time, gloo's threads included: less distorted by a shared machine
than wall time; and the main thread's alone, the Python and kernels in and around the schedule).
`--faults` reports, per system and rank, the median minor page faults (getrusage's ru_minflt) and CPU ms
(process time, all threads) per step over the measured steps (DeepSpeed's peer reports the same two). A
shared machine's load does not inflate the counts as it does the times, but they differ from run to run
of the same code with where glibc's heap top lies (docs/pipeline_measurements.md, 2026-12-07).
`--tensor-parallel T` adds pipeline × tensor parallelism rows instead: examples/gpt_pipe.py's GPT
(d_model 256, 4 blocks, seq 64) in 1F1B on `stages` × T ranks with AutoTP (`autotp_size: T`), with
`pipeline.pipe_partitioned`/`grad_partitioned` true (the default: slices cross the boundary) and false
(whole tensors), next to the same model on `stages` ranks without it; each row gives the bytes the
busiest rank sent to its neighbour stages per step (counted on torch's send ops). DeepSpeed has no
peer row here: its PipelineEngine takes tensor parallelism only from a Megatron `mpu`, not from AutoTP.
`--zero-data D` runs dstrain's 1F1B on `stages` × D ranks at ZeRO-1 and ZeRO-3 instead (each stage's
parameters gathered once per step: engine/pipe/zero3.py), with the all-gathers per step, their bytes and
the parameter elements a rank holds between steps (DeepSpeed refuses ZeRO-3 with its pipeline: no peer).
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import pipe_workload as wl  # noqa: E402
from tests.harness import run_distributed  # noqa: E402

SCHEDULES = ("1f1b", "eager_1f1b", "zb_h1", "gpipe", "interleaved_1f1b", "zero_bubble")


def measured(times: list[float]) -> float:
    """The median of the last min(15, N - 1) step times (the first builds; the next ones warm up)."""
    return statistics.median(times[-min(15, len(times) - 1):])


def _dstrain_stepper(schedule: str, m: int, steps: int):
    """(engine, module, step(i)) for dstrain's train_batch on the workload with `pipeline.schedule`."""
    import torch.distributed as dist
    import engine
    from engine.pipe import PipelineModule
    stages, virtual = dist.get_world_size(), 2 if schedule in ("interleaved_1f1b", "zero_bubble") else 1
    pm = PipelineModule(wl.layers(), num_stages=stages, loss_fn=wl.loss_fn, partition_method="uniform",
                        virtual_stages=virtual)
    cfg = {"train_micro_batch_size_per_gpu": wl.MICRO, "gradient_accumulation_steps": m,
           "optimizer": {"type": "SGD", "params": {"lr": 1e-3}}, "pipeline": {"schedule": schedule},
           "steps_per_print": 10**9}
    eng, *_ = engine.initialize(model=pm, config=cfg)
    data = wl.micro_batches(m * steps)
    return eng, pm, lambda i: eng.train_batch(iter(data[i * m:(i + 1) * m]))


def _torch_stepper(m: int, steps: int):
    """step(i) for torch's own PipelineStage + Schedule1F1B (GPipe when m < stages) on the same layers."""
    import torch
    import torch.distributed as dist
    from torch.distributed import pipelining as tp
    rank, world = dist.get_rank(), dist.get_world_size()
    per = len(wl.layers()) // world
    mod = torch.nn.Sequential(*wl.layers()[rank * per:(rank + 1) * per])
    stage = tp.PipelineStage(mod, rank, world, torch.device("cpu"))
    cls = tp.Schedule1F1B if m >= world else tp.ScheduleGPipe
    sched = cls(stage, n_microbatches=m, loss_fn=wl.loss_fn)
    opt = torch.optim.SGD(mod.parameters(), lr=1e-3)
    data = wl.micro_batches(m * steps)

    def step(i: int) -> None:
        if rank == 0:
            sched.step(torch.cat([x for x, _ in data[i * m:(i + 1) * m]]))
        elif rank == world - 1:
            sched.step(target=torch.cat([y for _, y in data[i * m:(i + 1) * m]]))
        else:
            sched.step()
        opt.step()
        opt.zero_grad()
    return step


def _timed(step, i: int) -> float:
    t0 = time.perf_counter()
    step(i)
    return (time.perf_counter() - t0) * 1e3


def _timed_cpu(step, i: int) -> tuple[float, float, float]:
    """(wall ms, this process's CPU ms, all its threads: gloo's transport included, and the calling
    thread's CPU ms: the Python and kernels around and inside the schedule, without gloo's threads) of
    one step."""
    c0, m0, t0 = time.process_time(), time.thread_time(), time.perf_counter()
    step(i)
    return (time.perf_counter() - t0) * 1e3, (time.process_time() - c0) * 1e3, (time.thread_time() - m0) * 1e3


def _dstrain(schedule: str, m: int, steps: int) -> dict:
    from engine.checkpointing import SavedActivationProbe
    from engine.pipe.schedule import idle_fractions
    from engine.pipe.stage_clock import pipeline_idle
    eng, pm, step = _dstrain_stepper(schedule, m, steps)
    times, records = [], []  # the step times and this stage's clock record of each step
    for i in range(steps - 1):
        times.append(_timed(step, i))
        records.append(eng.idle_record())
    with SavedActivationProbe(pm.parameters()) as probe:
        times.append(_timed(step, steps - 1))
    records.append(eng.idle_record())
    # each step's idle fraction over the pipeline's span, from every stage's records, gathered once after
    # the steps (a collective between steps would line the ranks up: a barrier the other systems lack)
    every = eng.pipe_comm.all_gather_object(records)
    idle_each = [pipeline_idle([r[k] for r in every])[eng.stage_id] for k in range(steps)]
    idle = idle_fractions(eng.schedule_actions(), eng.num_stages * pm.virtual_stages)
    eng.destroy()
    return {"step_ms": measured(times), "bubble": max(idle.values()), "act_bytes": probe.peak_bytes,
            "measured_idle": measured(idle_each)}


def _torch_native(m: int, steps: int) -> dict:
    step = _torch_stepper(m, steps)
    return {"step_ms": measured([_timed(step, i) for i in range(steps)])}


def _faults(system: str, m: int, steps: int) -> dict:
    """This rank's median minor page faults and CPU ms per step of `system` (a dstrain schedule, or
    "torch": its bare schedule) over the measured steps."""
    import resource
    step = _torch_stepper(m, steps) if system == "torch" else _dstrain_stepper(system, m, steps)[2]
    faults, cpu = [], []
    for i in range(steps):
        f0, c0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.process_time()
        step(i)
        cpu.append((time.process_time() - c0) * 1e3)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    return {"faults": measured(faults), "cpu_ms": measured(cpu)}


def _fault_rows(stages: int, ms: list[int], steps: int, systems: tuple, venv: str | None) -> None:
    print(f"{'p':>2} {'m':>2} {'system':<24} {'minor faults/step per rank':>26} {'CPU ms/step per rank':>21}")
    for m in ms:
        rows = {s: run_distributed(_faults, world_size=stages, args=(s, m, steps), timeout=1800) for s in systems}
        if venv:
            ds = _deepspeed(venv, stages, m, steps, full=True)
            if ds is not None:
                rows["deepspeed"] = [{"faults": f, "cpu_ms": c} for f, c in zip(ds["faults"], ds["cpu_ms"])]
        for system, ranks in rows.items():
            faults = "/".join(f"{r['faults']:.0f}" for r in ranks)
            cpu = "/".join(f"{r['cpu_ms']:.1f}" for r in ranks)
            print(f"{stages:>2} {m:>2} {system:<24} {faults:>26} {cpu:>21}", flush=True)


def _paired(m: int, steps: int) -> dict:
    """dstrain's 1f1b and torch's bare schedule stepped alternately in the same processes: each pair of
    steps sees the same load, so their ratio is steadier than that of separate runs. Each timed step
    starts from aligned ranks (an untimed barrier): torch's step ends on each rank when that rank is
    done (the last stage one backward before the first), dstrain's on the norm's all-reduce, so without
    it the skew torch's step leaves was timed in the next dstrain step (m = 1, 256 rows, one run on the
    shared machine: 1.30 without, 1.04 with the barrier, at equal CPU per step)."""
    import torch.distributed as dist
    eng, _, ours = _dstrain_stepper("1f1b", m, steps)
    theirs = _torch_stepper(m, steps)

    def aligned(step, i: int):
        dist.barrier()
        return _timed_cpu(step, i)
    pairs = [(aligned(ours, i), aligned(theirs, i)) for i in range(steps)]
    eng.destroy()
    return {"dstrain": [a[0] for a, _ in pairs], "torch": [b[0] for _, b in pairs],
            "dstrain_cpu": measured([a[1] for a, _ in pairs]), "torch_cpu": measured([b[1] for _, b in pairs]),
            "dstrain_main": measured([a[2] for a, _ in pairs]), "torch_main": measured([b[2] for _, b in pairs])}


def _paired_rows(stages: int, ms: list[int], steps: int) -> None:
    print(f"{'p':>2} {'m':>2} {'dstrain-1f1b ms':>15} {'torch ms':>9} {'median pair ratio':>17} "
          f"{'CPU ms/step per rank, dstrain':>29} {'torch':>13} {'main thread, dstrain':>20} {'torch':>13}")
    for m in ms:
        ranks = run_distributed(_paired, world_size=stages, args=(m, steps), timeout=1800)
        slowest = {k: [max(r[k][i] for r in ranks) for i in range(steps)] for k in ("dstrain", "torch")}
        ratios = [a / b for a, b in zip(slowest["dstrain"], slowest["torch"])]
        cpu = {k: "/".join(f"{r[k]:.1f}" for r in ranks)
               for k in ("dstrain_cpu", "torch_cpu", "dstrain_main", "torch_main")}
        print(f"{stages:>2} {m:>2} {measured(slowest['dstrain']):>15.1f} {measured(slowest['torch']):>9.1f} "
              f"{measured(ratios):>17.2f} {cpu['dstrain_cpu']:>29} {cpu['torch_cpu']:>13} "
              f"{cpu['dstrain_main']:>20} {cpu['torch_main']:>13}", flush=True)


def _timeline(m: int, steps: int, record: int) -> dict:
    """dstrain's 1f1b: `steps` warm-up train_batches, then `record` more with every event timed
    (benchmarks/pipe_timeline.py); this rank's events and the (start, end) of each recorded step."""
    from benchmarks import pipe_timeline
    eng, _, step = _dstrain_stepper("1f1b", m, steps + record)
    for i in range(steps):
        step(i)
    events, spans = [], []
    with pipe_timeline.recording(eng, events):
        for i in range(steps, steps + record):
            t0 = time.perf_counter()
            step(i)
            spans.append((t0, time.perf_counter()))
    eng.destroy()
    return {"events": events, "spans": spans}


def _timeline_rows(stages: int, ms: list[int], steps: int) -> None:
    from benchmarks import pipe_timeline
    for m in ms:
        ranks = run_distributed(_timeline, world_size=stages, args=(m, steps, 2), timeout=1800)
        print(f"## dstrain-1f1b p={stages} m={m}, {wl.MICRO} rows: events as 'label start-end' in ms")
        print(pipe_timeline.summarize([r["events"] for r in ranks], [r["spans"] for r in ranks]), flush=True)


def _gpt_pipe(stages: int, degree: int, m: int, steps: int, sliced: bool = True) -> dict:
    """1F1B on the GPT layer list, pipe `stages` × model `degree` (AutoTP), ZeRO-1, AdamW; `sliced`:
    pipeline.pipe_partitioned and grad_partitioned (each tensor rank sends 1/degree of the boundary)."""
    import torch
    import torch.distributed as dist
    import engine
    from engine.pipe import PipelineModule
    from engine.topology import Topology
    from examples.gpt import GPTConfig, RandomTokens
    from examples.gpt_pipe import gpt_layers, gpt_loss
    cfg = GPTConfig(vocab_size=256, seq_len=64, n_layer=4, n_head=4, d_model=256)
    topo = Topology.for_world(dist.get_world_size(), pipe=stages, model=degree)
    pm = PipelineModule(gpt_layers(cfg), topology=topo, loss_fn=gpt_loss, seed_layers=True,
                        partition_method="type:BlockLayer")
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": m, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 1},
              "tensor_parallel": {"autotp_size": degree},
              "pipeline": {"pipe_partitioned": sliced, "grad_partitioned": sliced}}
    eng, *_ = engine.initialize(model=pm, config=config)
    data = RandomTokens(4 * m * steps, cfg.seq_len, cfg.vocab_size)
    times = []
    for i in range(steps):
        batch = iter([tuple(torch.stack(t) for t in zip(*(data[4 * (i * m + k) + j] for j in range(4))))
                      for k in range(m)])
        t0 = time.perf_counter()
        eng.train_batch(batch)
        times.append((time.perf_counter() - t0) * 1e3)
    sent = eng.boundary_bytes()
    eng.destroy()
    return {"step_ms": measured(times), "sent_per_step": (sent["forward"] + sent["backward"]) / steps}


def _zero_on_grid(stages: int, zero: int, m: int, steps: int) -> dict:
    """dstrain's 1F1B on `stages` × (world / stages) data ranks at ZeRO `zero` (3: engine/pipe/zero3.py):
    step time, all-gather calls and bytes per step, and the parameter elements this rank holds between
    steps (at ZeRO-3 its 1/data partition, as placeholders)."""
    import resource

    import torch.distributed as dist

    import engine
    from engine.pipe import PipelineModule
    from engine.topology import Topology
    topo = Topology.for_world(dist.get_world_size(), pipe=stages)
    pm = PipelineModule(wl.layers(), topology=topo, loss_fn=wl.loss_fn, partition_method="uniform")
    cfg = {"train_micro_batch_size_per_gpu": wl.MICRO, "gradient_accumulation_steps": m, "steps_per_print": 10**9,
           "optimizer": {"type": "SGD", "params": {"lr": 1e-3}}, "zero_allow_untested_optimizer": True,
           "zero_optimization": {"stage": zero}}
    eng, *_ = engine.initialize(model=pm, config=cfg)
    data = wl.micro_batches(m * steps)
    times = []
    for i in range(steps):
        eng.comm.stats.reset()
        times.append(_timed(lambda k: eng.train_batch(iter(data[k * m:(k + 1) * m])), i))
    stats = eng.comm.stats.snapshot()
    held = sum(p.numel() for p in pm.parameters())
    eng.destroy()
    return {"step_ms": measured(times), "all_gathers": stats["calls"].get("all_gather", 0),
            "gather_kb": stats["bytes"].get("all_gather", 0) / 1024, "held": held,
            "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _zero_rows(stages: int, data: int, ms: list[int], steps: int) -> None:
    print(f"{'p':>2} {'dp':>2} {'m':>2} {'system':<20} {'step ms':>9} {'vs zero1':>8} {'all-gathers/step':>16} "
          f"{'gathered KB/step':>16} {'module elems held':>17} {'peak RSS MB':>11}")
    for m in ms:
        rows = {z: run_distributed(_zero_on_grid, world_size=stages * data, args=(stages, z, m, steps), timeout=1800)
                for z in (1, 3)}
        base = max(r["step_ms"] for r in rows[1])
        for z, ranks in rows.items():
            step = max(r["step_ms"] for r in ranks)
            print(f"{stages:>2} {data:>2} {m:>2} {f'dstrain-1f1b-zero{z}':<20} {step:>9.1f} {step / base:>8.2f} "
                  f"{max(r['all_gathers'] for r in ranks):>16} {max(r['gather_kb'] for r in ranks):>16.1f} "
                  f"{max(r['held'] for r in ranks):>17} {max(r['rss_mb'] for r in ranks):>11.0f}")


def _tensor_parallel_rows(stages: int, degree: int, ms: list[int], steps: int) -> None:
    print(f"{'p':>2} {'m':>2} {'system':<34} {'ranks':>5} {'step ms':>9} {'vs tp1':>6} {'boundary KB/step/rank':>21}")
    for m in ms:
        runs = {"": run_distributed(_gpt_pipe, world_size=stages, args=(stages, 1, m, steps), timeout=1800)}
        for sliced in (True, False):
            runs[f"-autotp{degree}" + ("" if sliced else "-whole")] = run_distributed(
                _gpt_pipe, world_size=stages * degree, args=(stages, degree, m, steps, sliced), timeout=1800)
        base = max(r["step_ms"] for r in runs[""])
        for suffix, ranks in runs.items():
            step = max(r["step_ms"] for r in ranks)
            sent = max(r["sent_per_step"] for r in ranks) / 1024
            print(f"{stages:>2} {m:>2} {'dstrain-1f1b-gpt' + suffix:<34} {len(ranks):>5} {step:>9.1f} "
                  f"{step / base:>6.2f} {sent:>21.1f}")


def _all(stages: int, ms: list[int], steps: int, systems: tuple = (*SCHEDULES, "torch")) -> dict:
    """Each of `systems` (dstrain's schedules, "torch": its bare schedule) at each m, in these processes."""
    out = {}
    for m in ms:
        for system in systems:
            if system in ("interleaved_1f1b", "zero_bubble") and m % stages:
                continue  # torch's interleaved schedules need m to be a multiple of the stage count
            out[(system, m)] = _torch_native(m, steps) if system == "torch" else _dstrain(system, m, steps)
    return out


def _deepspeed(venv: str, stages: int, m: int, steps: int, full: bool = False):
    """DeepSpeed's step ms (the slowest rank's); `full`: the peer's whole record (faults, CPU per rank)."""
    peer = Path(__file__).resolve().parent / "deepspeed_pipe_peer.py"
    proc = subprocess.run([str(Path(venv) / "bin" / "python"), str(peer), "--stages", str(stages),
                           "--micro-batches", str(m), "--steps", str(steps)], capture_output=True, text=True,
                          timeout=900)
    if proc.returncode != 0:
        print(f"deepspeed p={stages} m={m} failed: {proc.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return None
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    return record if full else record["step_ms"]


def _round(stages: int, ms: list[int], steps: int, venv: str | None, deepspeed_first: bool,
           systems: tuple, separate: bool) -> dict:
    """One round on `stages` ranks: {(system, m): row}, each row the slowest rank's step time. For each m
    dstrain's schedules and torch's run in one set of processes (`separate`: each in its own, as
    DeepSpeed's is) and DeepSpeed's right before or after (alternating between rounds), so the ratios of a
    round compare runs seconds apart."""
    out = {}
    for m in ms:
        ours = [lambda *a, s=s: _our_rows(*a, (s,)) for s in systems] if separate else [
            lambda *a: _our_rows(*a, systems)]
        order = ([_deepspeed_rows] + ours) if deepspeed_first else (ours + [_deepspeed_rows])
        for rows in order:
            out.update(rows(stages, m, steps, venv))
    return out


def _our_rows(stages: int, m: int, steps: int, venv: str | None, systems: tuple) -> dict:
    ranks = run_distributed(_all, world_size=stages, args=(stages, [m], steps, systems), timeout=1800)
    return {key: {**ranks[0][key], "step_ms": max(r[key]["step_ms"] for r in ranks),
                  "acts": "/".join(f"{r[key]['act_bytes'] / 1024:.0f}" for r in ranks) if key[0] != "torch" else "",
                  "measured": [r[key]["measured_idle"] for r in ranks] if key[0] != "torch" else None}
            for key in ranks[0]}


def _deepspeed_rows(stages: int, m: int, steps: int, venv: str | None) -> dict:
    ds = _deepspeed(venv, stages, m, steps) if venv else None
    return {("deepspeed", m): {"step_ms": ds}} if ds is not None else {}


def _print_rows(stages: int, ms: list[int], rounds: list[dict]) -> None:
    from engine.pipe.schedule import formula_bubble
    for m in ms:
        for system in ("deepspeed", *SCHEDULES, "torch"):
            have = [r for r in rounds if (system, m) in r]  # a DeepSpeed run that aborted left its round out
            if not have:
                continue
            steps = [r[(system, m)]["step_ms"] for r in have]
            ratios = [r[(system, m)]["step_ms"] / r[("deepspeed", m)]["step_ms"] for r in rounds
                      if ("deepspeed", m) in r]
            ratio = f"{statistics.median(ratios):>6.2f}" if ratios else f"{'-':>6}"
            each = ",".join(f"{x:.2f}" for x in ratios)
            row = have[0][(system, m)]
            name = {"deepspeed": "deepspeed-1f1b", "torch": "torch-native"}.get(system, "dstrain-" + system)
            extra = ""
            if "bubble" in row:
                v = 2 if system in ("interleaved_1f1b", "zero_bubble") else 1
                # per stage, the median over rounds of each round's median measured idle fraction
                # three decimals, as the formula: "within 10%" of 0.040 is a question of the third
                idle = "/".join(f"{statistics.median(r[(system, m)]['measured'][s] for r in have):.3f}"
                                for s in range(stages))
                extra = (f"{row['bubble']:>7.3f} {formula_bubble(system, stages, m, v):>7.3f} {idle:>23} "
                         f"{row['acts']:>16}")
            print(f"{stages:>2} {m:>2} {name:<24} {statistics.median(steps):>9.1f} {ratio} {each:<16} {extra}")


def _parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", default="2,4")
    p.add_argument("--micro-batches", default="1,4,8")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (per m: dstrain+torch, DeepSpeed)")
    p.add_argument("--deepspeed-venv", default=None)
    p.add_argument("--tensor-parallel", type=int, default=1, help="T > 1: the pipeline x tensor-parallel rows")
    p.add_argument("--paired", action="store_true", help="only dstrain's 1f1b vs torch's, alternating steps")
    p.add_argument("--timeline", action="store_true",
                   help="only a per-rank timeline of 2 dstrain-1f1b steps after --steps warm-up ones")
    p.add_argument("--micro-size", type=int, default=None,
                   help=f"rows per micro-batch (default {wl.MICRO}); set for every rank and DeepSpeed's peer")
    p.add_argument("--width", type=int, default=None,
                   help=f"the layers' width (default {wl.D}); set for every rank and DeepSpeed's peer")
    p.add_argument("--systems", default=",".join((*SCHEDULES, "torch")),
                   help="dstrain's schedules to run, and 'torch' for torch's bare schedule (default: all)")
    p.add_argument("--separate", action="store_true",
                   help="each of --systems in its own processes, as DeepSpeed's runs (default: one set for all)")
    p.add_argument("--faults", action="store_true",
                   help="only minor page faults and CPU ms per step per rank of --systems (and DeepSpeed's)")
    p.add_argument("--zero-data", type=int, default=0,
                   help="D > 0: only dstrain's 1f1b at ZeRO-1 and ZeRO-3 on stages x D ranks (engine/pipe/zero3.py)")
    return p.parse_args()


def _single_mode(args) -> bool:
    """Runs the one measurement a mode flag asks for (--timeline, --paired, --faults, --zero-data,
    --tensor-parallel) on every stage count; False when none is set."""
    ms = [int(m) for m in args.micro_batches.split(",")]
    modes = [(args.timeline, lambda st: _timeline_rows(st, ms, args.steps)),
             (args.paired, lambda st: _paired_rows(st, ms, args.steps)),
             (args.faults, lambda st: _fault_rows(st, ms, args.steps, tuple(args.systems.split(",")),
                                                  args.deepspeed_venv)),
             (args.zero_data > 0, lambda st: _zero_rows(st, args.zero_data, ms, args.steps)),
             (args.tensor_parallel > 1, lambda st: _tensor_parallel_rows(st, args.tensor_parallel, ms, args.steps))]
    run = next((fn for on, fn in modes if on), None)
    if run is None:
        return False
    for stages in [int(x) for x in args.stages.split(",")]:
        run(stages)
    return True


def main() -> int:
    args = _parse_args()
    if args.micro_size is not None:  # before the first spawn: the ranks and the peer import the workload anew
        os.environ["DSTRAIN_PIPE_MICRO"] = str(args.micro_size)
        wl.MICRO = args.micro_size
    if args.width is not None:
        os.environ["DSTRAIN_PIPE_WIDTH"] = str(args.width)
        wl.D = args.width
    print(f"micro-batch rows: {wl.MICRO}, width: {wl.D}" +
          (" (the --tensor-parallel rows' GPT takes neither)" if args.tensor_parallel > 1 else ""))
    print(f"load before: {os.getloadavg()}")
    if _single_mode(args):
        print(f"load after: {os.getloadavg()}")
        return 0
    ms = [int(m) for m in args.micro_batches.split(",")]
    for stages in [int(s) for s in args.stages.split(",")]:
        rounds = []
        for k in range(args.rounds):
            rounds.append(_round(stages, ms, args.steps, args.deepspeed_venv, deepspeed_first=k % 2 == 1,
                                 systems=tuple(args.systems.split(",")), separate=args.separate))
            print(f"# p={stages} round {k + 1}/{args.rounds} done, load {os.getloadavg()}", flush=True)
        print(f"{'p':>2} {'m':>2} {'system':<24} {'step ms':>9} {'vs DS':>6} {'per round':<16} {'replay':>7} "
              f"{'formula':>7} {'measured idle/stage':>23} {'act KB/stage':>16}")
        _print_rows(stages, ms, rounds)
    print(f"load after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
