"""The training runs tests/test_offload_parity.py (CPU tier) and tests/test_offload_nvme.py (NVMe tier)
assert on: one 2-rank spawn for both files, each reference run (no offload) trained once and shared.

Every run: 10 steps of tests.models.ReuseNet on 2 ranks, micro-batch 2, gradient accumulation 2, a
WarmupLR schedule (an offloaded step must see every new learning rate), AdamW with clipping that
bites or SGD without clipping (linear in the gradient: a wrong scale moves the weights), ZeRO-3
parameters above 30 elements partitioned. `SUB_GROUP` 100 (rounded up to 128 by nvme_tier.py's lanes
note) divides no partition. Copies are staged (DSTRAIN_OFFLOAD_STAGE_COPIES=1) as on an accelerator,
except in the "unstaged" case. Keys: (stage, optimizer, offload) for fp32, (precision, stage, offload)
for fp16/bf16, ("inf", precision, stage, offload) for an Inf on rank 1's loss at step INF_STEP.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import io
import os
import traceback
from pathlib import Path

import torch

import engine
import schemas
from engine.utils import safe_get_full_fp32_param
from engine.zero.partition_store import HalfImageStore
from tests.harness import run_distributed
from tests.models import ReuseNet, StackNet, make_batches, micro_batches

STEPS, MICRO, GAS, INF_STEP, SUB_GROUP, RESUME_AT = 10, 2, 2, 4, 100, 5
OPTIMIZERS = {"adamw": {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.01}},
              "sgd": {"type": "SGD", "params": {"lr": 0.2}}}
OPT_CPU = {"offload_optimizer": {"device": "cpu"}}
PARAM_CPU = {"offload_param": {"device": "cpu"}}
BOTH_CPU = {**OPT_CPU, **PARAM_CPU}
NVME = "nvme"  # offload_optimizer on NVMe under the run's nvme_path (`_nvme`)
NVME_PARAM_CPU = "nvme+param_cpu"  # and offload_param on the host
PARAM_NVME = "param_nvme"  # offload_param on NVMe, offload_optimizer on the host
BOTH_NVME = "both_nvme"  # both on NVMe: sample_configs/zero3_nvme.json's tiers
# Elements of parameter slots kept resident: StackNet keeps two of its layers' slots (288 each per rank),
# the rest from the files or a pool buffer still holding them; ReuseNet's one group (over 600) likewise.
MAX_IN_CPU = 600
# BOTH_NVME at DeepSpeed's default max_in_cpu (1e9): every slot resident after the first gathers, so a
# step writes no parameter byte (offload/param_swap.py's note: write-back), and the unset
# swap_gradients keeps the gradient in host memory (grad_swap.py's note: when)
BOTH_NVME_RESIDENT = "both_nvme+resident"
# BOTH_NVME with offload_optimizer.fast_init: its first step reads the master from the parameter files,
# which then hold fp32 in 16-bit training too (offload/param_swap.py's note: 16-bit files)
BOTH_NVME_FAST = "both_nvme+fast_init"
PARAM_NVME_BUFFERS = 3
# BOTH_NVME with a parameter buffer for every group StackNet reads from the files (the 5-deep one has 4):
# after the first gathers every group is found still in its buffer, across steps that write new values
# into them (offload/param_swap.py's note: kept buffers), so the files are read about once
BOTH_NVME_KEPT, KEPT_BUFFERS = "both_nvme+kept", 6
NVME_FAST = "nvme+fast_init"  # NVME with offload_optimizer.fast_init: no swap file written at initialisation
NVME_ONE_SLOT = "nvme+one_slot"  # NVME with offload_optimizer.swap_slots 1: the state files written in place
# The NVME runs above set offload_optimizer.swap_gradients true (the gradient partition in swap files);
# this one leaves it unset, which with the parameters in memory keeps the gradient in host memory
# (engine/zero/grad_swap.py's note: when). BOTH_NVME leaves it unset too: swapped, the parameters being on NVMe.
NVME_GRAD_MEMORY = "nvme+grad_memory"
# NVME with one gradient bucket per flat (reduce_bucket_size above the model): every landing writes whole
# norm ranges, so the step's norm takes their squares from the landings (grad_swap.py's note: folded norm)
NVME_FOLD = "nvme+fold"
FOLD_BUCKET = 1_000_000


def evict_kept(pool) -> None:
    """Every free buffer handed out and back untagged: the pool forgets the slots it kept (offload/pool.py's
    note: kept contents), so the next gather or read ahead of any group reads the files."""
    for buf in [pool.acquire() for _ in range(pool.free_count())]:
        pool.release(buf)


def _nvme(optimizer: str, nvme_path: str) -> dict:
    pipelined = optimizer == "adamw"  # 3 tensors per sub-group: 9 buffers hold read, step and write
    return {"sub_group_size": SUB_GROUP,
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 9 if pipelined else 4,
                                  "pipeline_read": pipelined, "pipeline_write": pipelined}}


def _param_nvme(nvme_path: str, max_in_cpu: int = MAX_IN_CPU) -> dict:
    return {"offload_param": {"device": "nvme", "nvme_path": nvme_path, "buffer_count": PARAM_NVME_BUFFERS,
                              "buffer_size": 100_000, "max_in_cpu": max_in_cpu}}


def config(stage: int, optimizer: str, offload, precision: str = "fp32", nvme_path: str | None = None) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
           "gradient_clipping": 0.3 if optimizer == "adamw" else 0.0, "optimizer": OPTIMIZERS[optimizer],
           "zero_allow_untested_optimizer": True,
           "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.02, "warmup_num_steps": 6}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 700, "allgather_bucket_size": 900,
                                 "overlap_comm": True, "stage3_param_persistence_threshold": 30}}
    if offload in (NVME, NVME_PARAM_CPU, NVME_FAST, NVME_ONE_SLOT, NVME_GRAD_MEMORY, NVME_FOLD):
        cfg["zero_optimization"].update(_nvme(optimizer, nvme_path), **(PARAM_CPU if offload == NVME_PARAM_CPU else {}))
        cfg["zero_optimization"]["offload_optimizer"]["fast_init"] = offload == NVME_FAST
        if offload != NVME_GRAD_MEMORY:
            cfg["zero_optimization"]["offload_optimizer"]["swap_gradients"] = True
        if offload == NVME_ONE_SLOT:
            cfg["zero_optimization"]["offload_optimizer"]["swap_slots"] = 1
        if offload == NVME_FOLD:
            cfg["zero_optimization"]["reduce_bucket_size"] = FOLD_BUCKET
        cfg["aio"] = {"block_size": 4096, "intra_op_parallelism": 2}
    elif offload in (PARAM_NVME, BOTH_NVME, BOTH_NVME_RESIDENT, BOTH_NVME_FAST, BOTH_NVME_KEPT):
        cfg["zero_optimization"].update(_nvme(optimizer, nvme_path) if offload != PARAM_NVME else OPT_CPU,
                                        **_param_nvme(nvme_path, 10**9 if offload == BOTH_NVME_RESIDENT else MAX_IN_CPU))
        if offload == BOTH_NVME_KEPT:
            cfg["zero_optimization"]["offload_param"]["buffer_count"] = KEPT_BUFFERS
        if offload == BOTH_NVME_FAST:
            cfg["zero_optimization"]["offload_optimizer"]["fast_init"] = True
        cfg["aio"] = {"block_size": 4096, "intra_op_parallelism": 2}
    else:
        cfg["zero_optimization"].update(offload)
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    elif precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _swap_hashes(zopt) -> dict:
    """SHA-256 of every swap file: the optimizer tier's and the parameter store's, and of the parameter
    partition read through the store (its resident copies are the truth for their elements)."""
    store = zopt.partition.store
    paths = [path for part in zopt.nvme.parts.values() for path in part._files.values()] if zopt.nvme else []
    paths += list(store.files.values()) if store.swapped else []
    out = {path: hashlib.sha256(Path(path).read_bytes()).hexdigest() for path in paths}
    for key, flat in zopt.partition.flat.items():
        out[f"partition {key}"] = hashlib.sha256(store.read(key, 0, flat.numel()).numpy().tobytes()).hexdigest()
        if isinstance(store, HalfImageStore):  # what stages 1-2 send in fp16/bf16: a 16-bit image, on the host
            image = store.read_image(key, 0, flat.numel()).contiguous()
            out[f"image {key}"] = hashlib.sha256(image.view(torch.uint8).numpy().tobytes()).hexdigest()
    return out


def _state_snapshot(zopt):
    """Every byte of this rank's offloaded state: the swap files' hashes with NVMe, else the master
    partitions and optimizer state tensors."""
    if zopt.nvme is not None or zopt.partition.store.swapped:
        return _swap_hashes(zopt)
    out = [f.detach().clone() for f in zopt.partition.flat.values()]
    for flat in zopt.partition.flat.values():
        out += [v.clone() for _, v in sorted(zopt.optimizer.state.get(flat, {}).items()) if torch.is_tensor(v)]
    return out


def _same_state(before, after) -> bool:
    if isinstance(before, dict):
        return len(before) > 0 and before == after
    return len(before) == len(after) > 0 and all(torch.equal(a, b) for a, b in zip(before, after))


def train(stage: int, optimizer: str, offload, precision: str = "fp32", inf: bool = False, zero_init: bool = False,
          meta: bool = False, resume: str | None = None, nvme_path: str | None = None, resume_into=None,
          model: str = "reuse") -> dict:
    """`meta`: torch's default device is `meta` from the model's construction on, so any buffer the
    offload path makes without naming its device fails (as in test_device_discipline.py). `resume`: a
    checkpoint directory; save there after RESUME_AT steps, rebuild the engine from other weights (with
    the offload `resume_into`, if given), load. `zero_init`: True builds under zero.Init with
    remote_device "cpu", a string with that remote_device. `model`: "reuse" (ReuseNet) or "stack" (StackNet)."""
    try:
        return _train(stage, optimizer, offload, precision, inf, zero_init, meta, resume, nvme_path, resume_into,
                      model)
    finally:
        # None, not "cpu": "cpu" would leave a device mode in place that intercepts every later torch
        # call of this process (36% of the next runs' CPU time), for the default a process starts with
        torch.set_default_device(None)


INIT_CHUNKS: list = []


def _frozen_stack() -> StackNet:
    """StackNet with its first hidden layer frozen: a frozen base layer, as in LoRA-style fine-tuning, whose
    chunks stage 3 keeps outside the optimizer's partition (engine/zero/stage3_frozen.py)."""
    model = StackNet()
    model.layers[0].requires_grad_(False)
    return model


# StackNet 5 deep: more groups read from the files than PARAM_NVME_BUFFERS keep (offload/param_swap.py's
# note: kept buffers), so gathers both read ahead and find groups still kept
MODELS = {"reuse": lambda: ReuseNet("reentrant"), "stack": lambda: StackNet(depth=5), "frozen": _frozen_stack}


def _build(cfg: dict, zero_init, meta: bool, model: str = "reuse"):
    if zero_init:
        with engine.zero.Init(config=cfg, remote_device="cpu" if zero_init is True else zero_init):
            model = MODELS[model]()
        # where each chunk is before initialize(): "SwappedChunk" when remote_device "nvme" wrote it to a file
        INIT_CHUNKS[:] = sorted({type(p._z3_chunk).__name__ for p in model.parameters()})
    else:
        model = MODELS[model]()
    if meta:
        torch.set_default_device("meta")
    return engine.initialize(model=model, config=cfg)[0]


def _gathered(p: torch.nn.Parameter) -> torch.Tensor:
    """A frozen parameter's full value (it has no fp32 master for safe_get_full_fp32_param to return)."""
    with engine.zero.GatheredParameters([p]):
        return p.data.detach().clone()


def _nvme_tier_summary(zopt, swap_dir) -> dict:
    """Where the NVMe optimizer tier kept what: its sub-groups and files, and the gradient partition (in
    host memory, or in swap files: engine/zero/grad_swap.py) with what its files moved."""
    swap = zopt.grad_swap
    return {"sub_groups": [part.groups for part in zopt.nvme.parts.values()],
            "state_in_memory": sum(len(s) for s in zopt.optimizer.state.values()),
            "masters_copied": sum(part.masters_copied for part in zopt.nvme.parts.values()),
            "swap_files": len(list(swap_dir.glob("*.swp"))),
            "state_file_bytes": sum(os.path.getsize(f) for part in zopt.nvme.parts.values() for f in part.paths
                                    if os.path.exists(f)),
            "grad_host_bytes": zopt.partition.num_bytes()["master_grad"],
            "grad_swap": None if swap is None else {
                "written": swap.bytes_written, "read": swap.bytes_read,
                "held": swap.held is not None,
                "reads_ahead_used": swap.reads_ahead_used, "read_ahead": swap.read_ahead,
                "norm_ranges_folded": swap.norm_ranges_folded,
                "held_files_made": swap.held.files_made if swap.held else 0,
                "held_file_left": swap.held is not None and os.path.exists(swap.held.path)}}


def _train(stage, optimizer, offload, precision, inf, zero_init, meta, resume, nvme_path, resume_into, model) -> dict:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    cfg = config(stage, optimizer, offload, precision, nvme_path)
    batches = make_batches(STEPS, MICRO * GAS * world)
    eng = _build(cfg, zero_init, meta, model)
    store = eng.zero_optimizer.partition.store
    written_at_build = store.bytes_written if store.swapped else 0  # the parameter files' first write
    nvme = eng.zero_optimizer.nvme
    at_init = len(list(nvme.swap.path.glob("*.swp"))) if nvme is not None else None  # fast_init writes none
    dtype = next(eng.module.parameters()).dtype
    norms, unchanged, param_bytes, in_flight = [], None, [], []
    for step, (x, y) in enumerate(batches):
        if resume is not None and step == RESUME_AT:
            eng.save_checkpoint(resume)
            eng.destroy()
            torch.manual_seed(1)  # other initial weights: only the checkpoint can make the run equal
            if resume_into is not None:
                cfg = config(stage, optimizer, resume_into, precision, nvme_path)
            eng = _build(cfg, zero_init, meta, model)
            eng.load_checkpoint(resume)
            store = eng.zero_optimizer.partition.store
            written_at_build = store.bytes_written if store.swapped else 0
        poison = inf and step == INF_STEP
        before = _state_snapshot(eng.zero_optimizer) if poison else None
        for k, (xm, ym) in enumerate(micro_batches(x.to(dtype), y.to(dtype), rank, world, GAS)):
            loss = eng(xm, ym, aux=k == 0)
            if poison and rank == 1 and k == GAS - 1:
                loss = loss * float("inf")
            eng.backward(loss)
            eng.step()
            if eng.zero_optimizer.partition.store.swapped:  # what exists after each micro-step
                param_bytes.append(eng.zero_optimizer.partition.store.measured_bytes())
                in_flight.append(eng.zero_optimizer.partition.store.writes_in_flight)
        if poison:
            unchanged = _same_state(before, _state_snapshot(eng.zero_optimizer))
        norms.append(eng.get_global_grad_norm())
    zopt = eng.zero_optimizer
    out = {"params": {n: safe_get_full_fp32_param(p) if p.requires_grad else _gathered(p)
                      for n, p in eng.module.named_parameters()},
           "init_chunks": list(INIT_CHUNKS) if zero_init else None,
           "norms": norms, "skipped": eng.skipped_steps, "unchanged": unchanged, "stage": zopt.stage,
           "home": str(zopt.tier.home), "staged": zopt.tier.staged,
           "flat_device": {str(f.device) for f in zopt.partition.flat.values()},
           # the whole fp32 partition read through the store at once (NVMe: its resident copies and files)
           "partition": [zopt.partition.store.read(k, 0, f.numel()).clone() for k, f in zopt.partition.flat.items()]}
    store = zopt.partition.store
    out["store"] = {"kind": type(store).__name__, "resident_bytes": store.resident_bytes(),
                    "flat_bytes": sum(f.untyped_storage().nbytes() for f in zopt.partition.flat.values()),
                    "partition_numel": sum(f.numel() for f in zopt.partition.flat.values())}
    if store.swapped:
        out["param_store"] = {"accounted_peak": store.peak_accounted, "measured": param_bytes,
                              "bound": store.max_in_cpu * 4 + store.pool.nbytes, "pool": store.pool.nbytes,
                              "read": store.bytes_read, "written": store.bytes_written,
                              "written_at_build": written_at_build,
                              "reads_ahead": store.reads_ahead, "kept_hits": store.kept_hits,
                              "reads_at_gather": store.reads_at_gather, "groups": len(store._slots),
                              "writes_behind": store.writes_behind,
                              "in_flight_after_step": in_flight,
                              "partition_bytes": zopt.model_state_bytes()["partition"],
                              "master_in_memory": store.master_in_memory, "dir": store.swap.path,
                              "file_dtype": str(store.dtype),
                              "file_bytes": sum(os.path.getsize(f) for f in store.files.values()),
                              "partition_numel": sum(f.numel() for f in zopt.partition.flat.values())}
    swap_dir = zopt.nvme.swap.path if zopt.nvme is not None else None
    if swap_dir is not None:
        out.update(_nvme_tier_summary(zopt, swap_dir), swap_files_at_init=at_init)
    frozen = getattr(zopt, "frozen_chunks", None)  # stage 3 only (engine/zero/stage3_frozen.py)
    frozen_file = frozen.file if frozen is not None else None
    if frozen is not None:
        out["frozen"] = {"count": len(frozen), "resident_bytes": frozen.resident_bytes(),
                         "reads_ahead": frozen.reads_ahead,
                         "file_bytes": os.path.getsize(frozen_file.path) if frozen_file else 0}
    eng.destroy()  # every run: 45 engines' process groups and gloo threads would pile up in this process
    if frozen_file is not None:
        out["frozen"]["dir_left"] = frozen_file.swap.path.exists()
    if swap_dir is not None:
        out["swap_dir_left"] = swap_dir.exists()
    if store.swapped:
        out["param_store"]["dir_left"] = store.swap.path.exists()
    return out


FP32_CASES = {
    **{(stage, opt, name): (stage, opt, offload) for stage in (1, 2, 3) for opt in ("adamw", "sgd")
       for name, offload in (("none", {}), ("opt_cpu", OPT_CPU), (NVME, NVME))},
    **{(3, opt, name): (3, opt, offload)
       for opt in ("adamw", "sgd") for name, offload in (("param_cpu", PARAM_CPU), ("both_cpu", BOTH_CPU))},
}
MIXED_CASES = {(precision, stage, name): (stage, "adamw", offload, precision)
               for precision in ("fp16", "bf16") for stage in (2, 3)
               for name, offload in (("none", {}), ("opt_cpu", OPT_CPU if stage < 3 else BOTH_CPU))}
MIXED_CASES.update({(precision, 2, NVME): (2, "adamw", NVME, precision) for precision in ("fp16", "bf16")})
INF_CASES = {("inf", precision, stage, name): (stage, "adamw", offload, precision, True)
             for precision, stage in (("fp16", 1), ("fp32", 3))
             for name, offload in (("none", {}), ("opt_cpu", OPT_CPU if stage < 3 else BOTH_CPU))}
INF_CASES.update({("inf", "fp32", stage, NVME): (stage, "adamw", NVME, "fp32", True) for stage in (1, 2, 3)})
INF_CASES.update({("inf", "fp32", stage, "none"): (stage, "adamw", {}, "fp32", True) for stage in (1, 2)})
# an fp16 overflow with 16-bit state on the host or in files: stage 2's send image, stage 3's parameter files
INF_CASES.update({("inf", "fp16", stage, name): (stage, "adamw", offload, "fp16", True)
                  for stage, name, offload in ((2, "none", {}), (2, NVME, NVME), (3, "none", {}), (3, BOTH_NVME, BOTH_NVME))})
# offload_param "nvme" (tests/test_offload_param_nvme.py): the references are FP32_CASES' "none" runs.
PARAM_NVME_CASES = {(3, opt, name): (3, opt, name) for opt in ("adamw", "sgd") for name in (PARAM_NVME, BOTH_NVME)}
PARAM_NVME_CASES[(3, "adamw", BOTH_NVME_RESIDENT)] = (3, "adamw", BOTH_NVME_RESIDENT)
PARAM_NVME_CASES[("inf", "fp32", 3, BOTH_NVME)] = (3, "adamw", BOTH_NVME, "fp32", True)
PARAM_NVME_CASES[("inf", "fp32", 3, BOTH_NVME_RESIDENT)] = (3, "adamw", BOTH_NVME_RESIDENT, "fp32", True)
# 16-bit training with the optimizer on the host: 16-bit parameter files (param_swap.py's note); the
# references are MIXED_CASES' stage-3 "none" runs
PARAM_NVME_CASES.update({(precision, 3, PARAM_NVME): (3, "adamw", PARAM_NVME, precision) for precision in ("fp16", "bf16")})
# ... and with the optimizer on NVMe too: the master is read from and written to the optimizer's files
PARAM_NVME_CASES.update({(precision, 3, BOTH_NVME): (3, "adamw", BOTH_NVME, precision) for precision in ("fp16", "bf16")})
PARAM_NVME_CASES[("bf16", 3, BOTH_NVME_FAST)] = (3, "adamw", BOTH_NVME_FAST, "bf16")
FAST_INIT_CASES = {(stage, opt, NVME_FAST): (stage, opt, NVME_FAST) for stage, opt in ((2, "sgd"), (3, "adamw"))}
ONE_SLOT_CASES = {(stage, opt, NVME_ONE_SLOT): (stage, opt, NVME_ONE_SLOT) for stage, opt in ((2, "adamw"), (3, "sgd"))}
GRAD_MEMORY_CASES = {(stage, opt, NVME_GRAD_MEMORY): (stage, opt, NVME_GRAD_MEMORY)
                     for stage, opt in ((1, "adamw"), (2, "adamw"), (2, "sgd"), (3, "adamw"))}
GRAD_MEMORY_CASES[("inf", "fp32", 2, NVME_GRAD_MEMORY)] = (2, "adamw", NVME_GRAD_MEMORY, "fp32", True)
FOLD_CASES = {(stage, opt, NVME_FOLD): (stage, opt, NVME_FOLD) for stage, opt in ((1, "adamw"), (2, "sgd"), (3, "adamw"))}
FOLD_CASES[("fp16", 2, NVME_FOLD)] = (2, "adamw", NVME_FOLD, "fp16")
FOLD_CASES[("inf", "fp32", 3, NVME_FOLD)] = (3, "adamw", NVME_FOLD, "fp32", True)


def _refusal(cfg: dict) -> list[str] | None:
    try:
        engine.initialize(model=ReuseNet("reentrant"), config=cfg)
        return None
    except schemas.ConfigError as error:
        return error.problems


def _all_cases(nvme_path: str, checkpoint_dir: str) -> dict:
    # What torch and the engine allocated at import lives to the end: out of the collector's sight, so
    # the gc.collect() of each destroy() walks only the objects of one run (1.3 s -> ms under load).
    gc.freeze()
    os.environ["DSTRAIN_OFFLOAD_STAGE_COPIES"] = "1"
    out = {key: train(*args, nvme_path=nvme_path) for key, args in {**FP32_CASES, **MIXED_CASES, **INF_CASES,
                                                                     **FAST_INIT_CASES, **ONE_SLOT_CASES,
                                                                     **GRAD_MEMORY_CASES, **FOLD_CASES}.items()}
    out[("resume", 3, NVME)] = train(3, "adamw", NVME_PARAM_CPU, resume=checkpoint_dir, nvme_path=nvme_path)
    out.update({key: train(*args, nvme_path=nvme_path) for key, args in PARAM_NVME_CASES.items()})
    for saved, loaded in ((BOTH_NVME, {}), ({}, BOTH_NVME), (PARAM_NVME, PARAM_NVME), (BOTH_NVME_RESIDENT, {})):
        name = f"{saved or 'none'}->{loaded or 'none'}"
        out[("resume", 3, name)] = train(3, "adamw", saved, resume=os.path.join(checkpoint_dir, name),
                                         nvme_path=nvme_path, resume_into=loaded)
    for name in ("none", BOTH_NVME, BOTH_NVME_RESIDENT, BOTH_NVME_KEPT):
        out[("stack", name)] = train(3, "sgd", name if name != "none" else {}, nvme_path=nvme_path, model="stack")
    # some groups resident, the rest in the files: the save's reads and the load's sub-group reads span both
    for saved, loaded in ((BOTH_NVME, {}), ({}, BOTH_NVME)):
        name = f"{saved or 'none'}->{loaded or 'none'}"
        out[("resume", "stack", name)] = train(3, "sgd", saved, resume=os.path.join(checkpoint_dir, "stack", name),
                                               nvme_path=nvme_path, resume_into=loaded, model="stack")
    for name in (PARAM_NVME, BOTH_NVME):  # zero.Init(remote_device="nvme"): straight into swap files
        out[("zero_init_nvme", name)] = train(3, "sgd", name, zero_init="nvme", nvme_path=nvme_path, model="stack")
    # bf16 with both tiers on NVMe (16-bit parameter files, the master in the optimizer's files): checkpoints
    # both ways, and zero.Init's bf16 chunks as the first master
    for saved, loaded in ((BOTH_NVME, {}), ({}, BOTH_NVME)):
        name = f"{saved or 'none'}->{loaded or 'none'}"
        out[("resume", "bf16", name)] = train(3, "adamw", saved, "bf16", resume=os.path.join(checkpoint_dir, "bf16", name),
                                              nvme_path=nvme_path, resume_into=loaded)
    for saved, loaded in ((NVME, {}), ({}, NVME)):  # stage 2: the 16-bit send image (partition_store.py)
        name = f"{saved or 'none'}->{loaded or 'none'}"
        out[("resume", "bf16", 2, name)] = train(2, "adamw", saved, "bf16", nvme_path=nvme_path, resume_into=loaded,
                                                 resume=os.path.join(checkpoint_dir, "bf16-2", name))
    for name in ("none", BOTH_NVME_KEPT):  # kept buffers of the 16-bit files
        out[("stack", "bf16", name)] = train(3, "sgd", name if name != "none" else {}, "bf16", nvme_path=nvme_path,
                                             model="stack")
    out[("zero_init_nvme", "bf16", BOTH_NVME)] = train(3, "sgd", BOTH_NVME, "bf16", zero_init="nvme",
                                                      nvme_path=nvme_path, model="stack")
    out.update(_frozen_cases(nvme_path, checkpoint_dir))
    out["zero_init_nvme_without_config"] = _init_refusal()
    out[("zero_init", "both_cpu")] = train(3, "sgd", BOTH_CPU, zero_init=True)
    out[("meta", 2)] = train(2, "sgd", OPT_CPU, meta=True)
    out[("meta", 3)] = train(3, "sgd", BOTH_CPU, meta=True)
    out["left_in_nvme_path"] = sorted(os.listdir(nvme_path))
    out["missing_path"] = _refusal(config(2, "sgd", NVME, nvme_path=os.path.join(nvme_path, "missing")))
    os.environ["DSTRAIN_OFFLOAD_STAGE_COPIES"] = "0"  # a CPU-only machine's own path: nothing staged
    out[("unstaged", "opt_cpu")] = train(2, "sgd", OPT_CPU)
    out["hf_gpt2"] = _seed_config_example(os.path.join(checkpoint_dir, "hf_gpt2"))  # last: it imports transformers
    return out


def _frozen_cases(nvme_path: str, checkpoint_dir: str) -> dict:
    """A frozen layer with parameters on NVMe (engine/zero/stage3_frozen.py): its chunks in a file, built
    normally and by zero.Init(remote_device="nvme"); checkpoints both ways (the reloaded run starts from
    other weights, frozen ones too, so only the load's write to the file can make it equal)."""
    out = {("frozen", name): train(3, "sgd", offload, nvme_path=nvme_path, model="frozen")
           for name, offload in (("none", {}), (PARAM_NVME, PARAM_NVME), (BOTH_NVME, BOTH_NVME),
                                 (BOTH_NVME_RESIDENT, BOTH_NVME_RESIDENT))}
    out[("frozen", "zero_init", BOTH_NVME)] = train(3, "sgd", BOTH_NVME, zero_init="nvme", nvme_path=nvme_path,
                                                    model="frozen")
    for saved, loaded in ((BOTH_NVME, {}), ({}, BOTH_NVME), ({}, BOTH_NVME_RESIDENT)):
        name = f"{saved or 'none'}->{loaded or 'none'}"
        out[("resume", "frozen", name)] = train(3, "sgd", saved, resume=os.path.join(checkpoint_dir, "frozen", name),
                                                nvme_path=nvme_path, resume_into=loaded, model="frozen")
    return out


def _init_refusal() -> list[str] | None:
    try:
        with engine.zero.Init(remote_device="nvme"):
            StackNet()
        return None
    except schemas.ConfigError as error:
        return error.problems


def _seed_config_example(out_dir: str) -> dict:
    """examples/train_hf_gpt2.py's main on these ranks with the seed's config (sample_configs/
    zero3_offload.json, fp16): its printed summary, or the traceback it raised."""
    from examples.train_hf_gpt2 import main
    repo = Path(__file__).resolve().parents[1]
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            code = main(["--fp16", "--steps", "4", "--out", out_dir,
                         "--deepspeed_config", os.fspath(repo / "sample_configs" / "zero3_offload.json")])
    except Exception:  # noqa: BLE001 - the test reports it; the other cases' results still come back
        return {"code": None, "printed": printed.getvalue() + traceback.format_exc()}
    return {"code": code, "printed": printed.getvalue()}


@functools.cache
def _runs(root: str) -> list[dict]:
    nvme_path, checkpoint_dir = os.path.join(root, "nvme"), os.path.join(root, "checkpoint")
    os.makedirs(nvme_path)
    return run_distributed(_all_cases, 2, args=(nvme_path, checkpoint_dir), timeout=420)


def shared_runs(tmp_path_factory) -> list[dict]:
    """Every rank's results, computed once per test session (the first file's fixture pays)."""
    return _runs(os.fspath(tmp_path_factory.getbasetemp() / "offload-runs"))


def assert_same(got: dict, want: dict, what: str) -> None:
    for name, w in want["params"].items():
        g = got["params"][name]
        assert torch.equal(g, w), f"{what} {name}: max |diff| {(g - w).abs().max().item():.3e}"
    assert got["norms"] == want["norms"], f"{what}: gradient norms {got['norms']} != {want['norms']}"
