"""The GPU script's offload checks (issue 17: ZeRO-Offload / ZeRO-Infinity); benchmarks/gpu/run.py runs
them on one rank and again on two, `--cpu` too.

Each case trains the tiny GPT STEPS steps with one offload setting and compares it with the same ZeRO
stage and precision without offload (trained once per rank and shared by the cases): every fp32 master
weight torch.equal after the steps, in fp32 and in bf16 (each against the run in its own precision).
Cases: `offload_optimizer` "cpu" and "nvme" at stages 1, 2 and 3; `offload_param` "cpu" and "nvme" at
stage 3 with the optimizer offloaded the same way and the model built under `zero.Init(remote_device=...)`
(both on NVMe in bf16: 16-bit parameter files, the master in the optimizer's files);
`offload_param` "nvme" with the optimizer on the host (in bf16: 16-bit parameter files); the GPT's
blocks frozen with both on NVMe (frozen chunks in a file of their own, read back at each gather).
[Note: bit for bit across devices] Without offload the optimizer steps on the accelerator, with it on the
host (torch's fused CPU kernels), and the two may round differently (a fused multiply-add on one side).
So the optimizer is SGD with momentum 0.5 and learning rate 2^-4, without weight decay: every product in
its update is by a power of two, hence exact, and each element rounds once, the same way, on either
device. Clipping is off: its norm sums on the device in another order than on the host. Attention runs
on SDPA's math backend: the memory-efficient kernel's backward accumulates with atomics on a GPU, so two
runs from the same weights could differ before offload changed anything.
[Note: placement] Asserted after the steps (the optimizer state exists then): the model's parameters (at
stage 3 the gathered ones) on the device; the partition's tensors (engine/zero/tier.py `tier_tensors`) on
the host; and on an accelerator, where `pin_memory` is left at its default (true), the fp32 flats and the
NVMe swap pools pinned, since the host<->device copies of them are asynchronous. On CPU the placement is
trivially right; the `--cpu` run stages the copies anyway (DSTRAIN_OFFLOAD_STAGE_COPIES=1, as the
offload tests do) so the accelerator's copy path runs there too. NVMe cases swap under a new directory
of the system temp dir, which must be empty again after `engine.destroy()` and is then removed.
"""
from __future__ import annotations

import contextlib
import os
import tempfile

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import engine
from benchmarks.gpu.training import MICRO, STEPS, TINY, batches, check_config, train
from engine.utils import safe_get_full_fp32_param
from engine.zero.tier import tier_tensors
from examples.gpt import GPT

SGD = {"type": "SGD", "params": {"lr": 2**-4, "momentum": 0.5}}  # note: bit for bit across devices
SUB_GROUP = 1000  # elements; rounded up to 1024 (nvme_tier.py's lanes note): several sub-groups per partition
# name -> the stages it runs at; "parameters" cases offload the optimizer to the same device
OFFLOADS = {"optimizer cpu": (1, 2, 3), "optimizer nvme": (1, 2, 3),
            "parameters+optimizer cpu": (3,), "parameters+optimizer nvme": (3,),
            # the optimizer on the host: in bf16 the parameter files, pool and copies hold bf16
            # (offload/param_swap.py's note: 16-bit files)
            "parameters nvme+optimizer cpu": (3,),
            # the GPT's blocks frozen: their chunks in a file of their own (engine/zero/stage3_frozen.py)
            "frozen blocks, parameters+optimizer nvme": (3,)}


def _devices(offload: str) -> tuple[str, str | None]:
    """(offload_optimizer device, offload_param device or None) of a case name."""
    if offload == "parameters nvme+optimizer cpu":
        return "cpu", "nvme"
    if offload.startswith("frozen blocks, "):
        return _devices(offload.removeprefix("frozen blocks, "))
    device = offload.split()[-1]
    return device, device if offload.startswith("parameters") else None
OFFLOAD_PRECISIONS = ("fp32", "bf16")
# Pinned on an accelerator (note: placement): what asynchronous host<->device copies read or write.
PINNED_ROLES = ("master", "swap_buffers")


def offload_config(stage: int, precision: str, offload: str | None, nvme_path: str | None = None) -> dict:
    """The checks' config (training.check_config) with SGD, no clipping, and `offload` (None: none)."""
    cfg = check_config(stage, precision, {"optimizer": SGD, "gradient_clipping": 0.0,
                                          "zero_allow_untested_optimizer": True})
    if offload is None:
        return cfg
    zero, (device, param_device) = cfg["zero_optimization"], _devices(offload)
    zero["offload_optimizer"] = {"device": device}
    if device == "nvme":  # SGD with momentum swaps 2 tensors per sub-group: 6 buffers read ahead and write behind
        zero["sub_group_size"] = SUB_GROUP
        zero["offload_optimizer"].update(nvme_path=nvme_path, buffer_count=6, pipeline_read=True, pipeline_write=True)
    if param_device is not None:
        zero["offload_param"] = {"device": param_device}
        if param_device == "nvme":  # max_in_cpu 0: every gather reads its chunks through the (pinned) pool
            zero["offload_param"].update(nvme_path=nvme_path, buffer_count=3, buffer_size=100_000, max_in_cpu=0)
    return cfg


@contextlib.contextmanager
def _staged_on_cpu(dev: torch.device):
    """On CPU, stage the copies as on an accelerator (note: placement); the setting is read at initialize."""
    if dev.type != "cpu":
        yield
        return
    before = os.environ.get("DSTRAIN_OFFLOAD_STAGE_COPIES")
    os.environ["DSTRAIN_OFFLOAD_STAGE_COPIES"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["DSTRAIN_OFFLOAD_STAGE_COPIES"]
        else:
            os.environ["DSTRAIN_OFFLOAD_STAGE_COPIES"] = before


def _run(stage: int, precision: str, offload: str | None, nvme_path: str | None, rank: int,
         syncs: list | None = None, frozen: bool = False) -> tuple[dict, list[float], str]:
    """Full fp32 masters (on the host; a frozen parameter's gathered value), losses and the placement
    summary of one trained engine; `frozen`: the GPT's blocks frozen."""
    cfg = offload_config(stage, precision, offload, nvme_path)
    dev = engine.dist.device()
    torch.manual_seed(0)
    if offload is not None and _devices(offload)[1] is not None:
        with engine.zero.Init(config_dict_or_path=cfg, remote_device=_devices(offload)[1]):
            model = GPT(TINY)
    else:
        model = GPT(TINY)
    if frozen:
        for block in model.blocks:
            block.requires_grad_(False)
    with _staged_on_cpu(dev) if offload is not None else contextlib.nullcontext():
        eng, _, _, _ = engine.initialize(model=model, config=cfg)
    try:
        with sdpa_kernel(SDPBackend.MATH):  # note: bit for bit across devices
            losses, found = train(eng, batches(STEPS, TINY, MICRO, rank), count_syncs=syncs is not None)
        if syncs is not None:
            syncs.extend(found)
        masters = {n: safe_get_full_fp32_param(p).cpu() for n, p in eng.module.named_parameters() if p.requires_grad}
        frozen_params = [(n, p) for n, p in eng.module.named_parameters() if not p.requires_grad]
        with engine.zero.GatheredParameters([p for _, p in frozen_params]) if stage == 3 else contextlib.nullcontext():
            masters.update({n: p.detach().float().cpu().clone() for n, p in frozen_params})
        # after every collective but its own gather: a rank that raises here leaves no other rank waiting
        where = _placement(eng, stage) if offload is not None else ""
    finally:
        eng.destroy()
    return masters, losses, where


def _placement(eng, stage: int) -> str:
    """Raise unless the model is on the device and the partition on the host (pinned on an accelerator)."""
    dev, params = eng.device, list(eng.module.parameters())
    with engine.zero.GatheredParameters(params) if stage == 3 else contextlib.nullcontext():
        wrong = sorted({str(p.device) for p in params} - {str(dev)})
        empty = [n for n, p in eng.module.named_parameters() if p.numel() == 0]
    if wrong or empty:
        raise AssertionError(f"model parameters on {wrong or dev}, empty (not gathered): {empty[:3]}")
    tensors = tier_tensors(eng.zero_optimizer)
    away = {role: sorted({str(t.device) for t in ts}) for role, ts in tensors.items()
            if any(t.device.type != "cpu" for t in ts)}
    if away:
        raise AssertionError(f"offloaded tensors not on the host: {away}")
    if not (tensors["master"] and tensors["optimizer_state"]) and not tensors["swap_buffers"]:
        raise AssertionError(f"neither master weights and optimizer state nor swap buffers on the host: "
                             f"{ {role: len(ts) for role, ts in tensors.items()} }")
    pinned = ""
    if dev.type != "cpu":
        unpinned = {role: sum(not t.is_pinned() for t in tensors[role]) for role in PINNED_ROLES}
        if any(unpinned.values()):
            raise AssertionError(f"host staging buffers not pinned (pin_memory is true): {unpinned}")
        pinned = ", pinned"
    return ", ".join(f"{len(ts)} {role}" for role, ts in tensors.items() if ts) + pinned


def check_offload(offload: str, stage: int, precision: str, rank: int = 0, syncs: dict | None = None,
                  name: str = "") -> str:
    frozen = offload.startswith("frozen blocks")
    key = (stage, precision, frozen)
    if key not in check_offload.reference:
        check_offload.reference[key] = _run(stage, precision, None, None, rank, frozen=frozen)[:2]
    want, want_losses = check_offload.reference[key]
    found = [] if syncs is not None else None
    with tempfile.TemporaryDirectory(prefix="dstrain-gpu-nvme-") as nvme_path:
        got, losses, where = _run(stage, precision, offload, nvme_path, rank, found, frozen=frozen)
        left = os.listdir(nvme_path)
    if left:
        raise AssertionError(f"engine.destroy() left {left} in the NVMe path")
    if syncs is not None:
        syncs[name] = found
    differ = [n for n in want if not torch.equal(got[n], want[n])]
    if differ:
        worst = max((got[n] - want[n]).abs().max().item() for n in differ)
        raise AssertionError(f"{len(differ)} parameter(s) differ from ZeRO-{stage} {precision} without offload, "
                             f"first {differ[0]}, max |diff| {worst:.2e}")
    return (f"fp32 masters equal to ZeRO-{stage} {precision} without offload; losses {losses[0]:.4f} -> "
            f"{losses[-1]:.4f} (without: {want_losses[-1]:.4f}); on the host: {where}")


check_offload.reference = {}  # (stage, precision, frozen) -> masters and losses without offload, on this rank


def offload_cases(rank: int = 0, syncs: dict | None = None) -> list[tuple]:
    """(check name, function, args) for run.py's run_checks; forgets the references of an earlier run."""
    check_offload.reference = {}
    cases = []
    for offload, stages in OFFLOADS.items():
        for stage in stages:
            for precision in OFFLOAD_PRECISIONS:
                name = f"offload {offload} ZeRO-{stage} {precision}"
                cases.append((name, check_offload, (offload, stage, precision, rank, syncs, name)))
    return cases
