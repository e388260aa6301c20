"""Per-rank memory of model state for each ZeRO stage x offload choice: `dstrain estimate`.

    from offload.estimate import estimate_memory
    rows = estimate_memory(params=1_300_000_000, nodes=1, gpus_per_node=8)   # list[MemoryEstimate]

Ψ parameters, N = nodes x gpus_per_node data-parallel ranks, Adam (two fp32 moments). The ZeRO paper's
accounting (arXiv:1910.02054 §3.1, §5), mixed precision: 2Ψ bytes of 16-bit weights, 2Ψ of 16-bit
gradients, 12Ψ of fp32 master weights and moments; stage 1 divides the 12Ψ by N, stage 2 the
gradients too, stage 3 everything. fp32 (`precision="fp32"`) is dstrain's layout: 4Ψ weights, 4Ψ
gradients, 8Ψ moments, and at stages 1-2 a separate fp32 master partition (4Ψ/N); at stage 3 the fp32
partition is the parameter. Offload moves the optimizer's share (master, moments and the fp32
partition gradient, 16Ψ/N) to host memory, or to NVMe where the swap pool stays on the host with the
partition gradient (4Ψ/N), or only its landings where it is swapped too (`offload_optimizer.swap_gradients`,
unset: with the parameters on NVMe and Ψ/N above `max_in_cpu`; `_swapped_gradient_staging`); at stages 1-2 the host also keeps
the fp32 send image of the all-gather, 4Ψ/N);
at stage 3 either offload section also moves the fp32 parameter partition (dstrain keeps no 16-bit
one) to the host, and parameter offload to NVMe moves it into swap files (`_stage3_partition`). Added on top:
gradient buckets in flight (REDUCE_DEPTH x `reduce_bucket_size`, stages 0-2), the stage-3 gathered
parameters (`max_live_parameters`, or the whole model when it fits), and the swap pools. Activations
and the framework's own memory are not model state and are not counted, nor is the first reducing
backward's hold of every full gradient where the loss's graph has a Python autograd Function such as
torch's reentrant checkpointing (arrivals.py's notes: 4 bytes per parameter for one backward, in memory
unless the gradient partition is swapped, then in a file; graphs of autograd's own nodes, and dstrain's
reentrant regions that share no parameter, hold nothing).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

OFFLOADS = ("none", "cpu optimizer", "nvme optimizer", "cpu params+optimizer", "nvme params+cpu optimizer",
            "nvme params+optimizer")
REDUCE_DEPTH = 4  # buckets in flight at stages 1-2 (engine/zero/partitioned.py)


@dataclass(frozen=True)
class MemoryEstimate:
    stage: int
    offload: str
    accelerator_bytes: int
    host_bytes: int
    nvme_bytes: int


@dataclass(frozen=True)
class EstimateSettings:
    """The config values the estimate depends on (DeepSpeed's defaults)."""

    precision: str = "fp16"  # "fp16" | "bf16" | "fp32"
    reduce_bucket_size: int = 500_000_000
    max_live_parameters: int = 1_000_000_000
    sub_group_size: int = 1_000_000_000
    optimizer_buffer_count: int = 4
    swap_slots: int = 2  # offload_optimizer.swap_slots: copies of the NVMe optimizer-state files
    swap_gradients: Optional[bool] = None  # offload_optimizer.swap_gradients (unset: NVMe parameters over max_in_cpu)
    param_buffer_count: int = 5
    param_buffer_size: int = 100_000_000
    max_in_cpu: int = 1_000_000_000
    fast_init: bool = False  # offload_optimizer.fast_init: fp32 parameter files in 16-bit training (stage-3 note)
    pipeline_read: bool = False  # offload_optimizer.pipeline_read: a swapped gradient's next range read ahead


def estimate_memory(params: int, nodes: int = 1, gpus_per_node: int = 1,
                    settings: EstimateSettings = EstimateSettings(), frozen: int = 0) -> list[MemoryEstimate]:
    """One row per (stage 0-3, offload choice) that DeepSpeed's config can express. `params`: trainable
    parameters; `frozen`: parameters without gradients (a LoRA base), weights only (`_frozen`)."""
    if params < 1 or nodes < 1 or gpus_per_node < 1 or frozen < 0:
        raise ValueError("params, nodes and gpus_per_node must be positive, frozen not negative")
    rows = []
    for stage in range(4):
        for offload in OFFLOADS:
            row = _estimate(stage, offload, params, nodes * gpus_per_node, settings, frozen)
            if row is not None:
                rows.append(row)
    return rows


def _estimate(stage: int, offload: str, psi: int, n: int, s: EstimateSettings,
              frozen: int = 0) -> Optional[MemoryEstimate]:
    if stage == 0 and offload != "none":
        return None  # offload moves a partition; stage 0 has none (DeepSpeed refuses it as well)
    if "params" in offload and stage != 3:
        return None  # parameter offload is a stage-3 feature
    half = s.precision in ("fp16", "bf16")
    wbytes = 2 if half else 4
    shard = n if stage >= 1 else 1
    weights = wbytes * psi if stage < 3 else wbytes * psi // n
    grads = wbytes * psi if stage < 2 else 0  # stage 2/3 keep only the fp32 partition gradient
    master = 4 * psi // shard if (half or stage in (1, 2)) else 0  # fp32 at stage 0/3: the parameter itself
    moments = 8 * psi // shard
    partition_grad = 4 * psi // n if stage >= 1 else 0
    buckets = _buckets(stage, psi, s, wbytes)
    optimizer_state = master + moments + partition_grad
    accel, host, nvme = weights + grads + buckets, 0, 0
    opt_dev = {"none": "none", "nvme optimizer": "nvme", "nvme params+optimizer": "nvme"}.get(offload, "cpu")
    if opt_dev == "none":
        accel += optimizer_state
    elif opt_dev == "cpu":
        host += optimizer_state
    else:  # the stepper swaps its own fp32 master with the moments, in swap_slots copies (swapped_partition.py)
        # stages 1-2: what the all-gather sends, on the host; in 16-bit training in the model dtype, except
        # with fast_init (engine/zero/partition_store.py's note: 16-bit send image)
        send_image = _image_bytes(half, "nvme", s) * psi // n if stage < 3 else 0
        swapped = s.swap_gradients if s.swap_gradients is not None else (offload.startswith("nvme params")
                                                                          and psi // n > s.max_in_cpu)
        staging = _swapped_gradient_staging(psi, n, s, stage == 3 and offload.startswith("nvme params"))
        host += (staging if swapped else partition_grad) + _optimizer_pool(psi // n, s)
        host += send_image
        nvme += s.swap_slots * (4 * psi // shard + moments) + (partition_grad if swapped else 0)
    if stage == 3 and offload != "none":
        accel -= weights
        host, nvme = _stage3_partition(offload, opt_dev, half, psi, n, s, host, nvme)
    if stage == 3:
        accel += wbytes * min(psi + frozen, s.max_live_parameters)  # gathered parameters while a unit runs
    placed = _frozen(stage, offload, frozen, psi, n, s, wbytes)
    return MemoryEstimate(stage, offload, accel + placed[0], host + placed[1], nvme + placed[2])


def _frozen(stage: int, offload: str, frozen: int, psi: int, n: int, s: EstimateSettings,
            wbytes: int) -> tuple[int, int, int]:
    """[Note: frozen parameters] (accelerator, host, NVMe) bytes of the frozen weights, in the model dtype,
    with no gradient and no optimizer state: whole on every rank at stages 0-2; at stage 3 a 1/N chunk
    each (engine/zero/stage3_frozen.py), on the accelerator without offload, on the host with either
    offload section; with parameters on NVMe as much as `max_in_cpu` leaves after the trainable
    partition stays on the host, the rest is in a chunk file, whose reads ahead of their gathers hold
    up to `param_buffer_count` groups on the host (counted as the pool's size, what a group may take)."""
    if stage < 3:
        return wbytes * frozen, 0, 0
    chunk = frozen // n
    if offload == "none":
        return wbytes * chunk, 0, 0
    if offload.startswith("nvme params"):
        resident = min(chunk, max(0, s.max_in_cpu - psi // n))
        on_file = chunk - resident
        ahead = min(on_file, s.param_buffer_count * s.param_buffer_size)
        return 0, wbytes * (resident + ahead), wbytes * on_file
    return 0, wbytes * chunk, 0


def _stage3_partition(offload: str, opt_dev: str, half: bool, psi: int, n: int, s: EstimateSettings,
                      host: int, nvme: int) -> tuple[int, int]:
    """[Note: stage-3 partition] dstrain keeps no 16-bit partition at stage 3: the fp32 partition is what
    the all-gathers send, and with either offload section it lives on the host (engine/zero/tier.py's
    stage-3 note), not on the accelerator. With the optimizer on the host in 16-bit training it *is* the
    master, counted already; otherwise it is added here. With parameters on NVMe it is in swap files
    (engine/zero/param_nvme.py): the host keeps the parameter pool and up to `max_in_cpu` resident
    elements, and with the optimizer on NVMe too no host copy at all. In 16-bit training the files, the pool
    and the resident copies hold 2 bytes per element (param_swap.py's note: 16-bit files), except with the
    optimizer on NVMe and its `fast_init`, whose first step reads the master from them."""
    flat = 4 * psi // n
    in_host = not (offload == "nvme params+optimizer")
    if in_host and not (opt_dev == "cpu" and half):
        host += flat
    if offload.startswith("nvme params"):
        fbytes = _image_bytes(half, opt_dev, s)
        nvme += fbytes * psi // n
        host += fbytes * (s.param_buffer_count * min(s.param_buffer_size, psi // n) + min(s.max_in_cpu, psi // n))
    return host, nvme


def _image_bytes(half: bool, opt_dev: str, s: EstimateSettings) -> int:
    """Bytes per element of what the all-gathers send, kept off the accelerator (stages 1-2's send image,
    stage 3's parameter files): the model dtype's in 16-bit training, except with the NVMe optimizer's
    `fast_init`, whose first step reads the master from it (fp32 then)."""
    return 2 if half and not (opt_dev == "nvme" and s.fast_init) else 4


def _buckets(stage: int, psi: int, s: EstimateSettings, wbytes: int) -> int:
    if stage == 0:
        return 0  # stage 0 all-reduces the gradients in place
    return wbytes * min(psi, REDUCE_DEPTH * s.reduce_bucket_size)  # never more in flight than the model


def _swapped_gradient_staging(psi: int, n: int, s: EstimateSettings, nvme_params: bool = False) -> int:
    """[Note: swapped gradient] With the optimizer on NVMe the partition gradient is in swap files
    (engine/zero/grad_swap.py); the host holds the landings in flight (DEPTH bucket segments) and the
    range being read (a sub-group, or a norm chunk; two with `pipeline_read`: the next one read ahead),
    whatever the optimizer (Lamb and Muon too), in the staging buffers (offload/staging.py), which keep
    a phase's buffers until the next phase asks for other sizes. A bucket holds at least one whole
    parameter, so a parameter larger than `reduce_bucket_size` lands whole: at stage 3 with the
    parameters on NVMe its share is bounded by `offload_param.buffer_size` (a gather group's share must
    fit one buffer); elsewhere the estimate does not know the largest parameter and takes the bucket."""
    from engine.zero.grad_swap import DEPTH, NORM_CHUNK
    landing = min(s.reduce_bucket_size, psi) // n
    if nvme_params:
        landing = max(landing, min(s.param_buffer_size, psi // n))
    reads = 2 if s.pipeline_read else 1
    return 4 * (DEPTH * landing + reads * min(max(s.sub_group_size, NORM_CHUNK), psi // n))


def _optimizer_pool(partition: int, s: EstimateSettings) -> int:
    from offload.swapped_partition import sub_group_buffer_elements
    return s.optimizer_buffer_count * 4 * sub_group_buffer_elements(partition, s.sub_group_size)


def count_parameters(spec: str) -> tuple[int, int]:
    """(trainable, frozen) parameters of `module:factory` (the factory is called with no arguments)."""
    import importlib

    import torch

    module_name, sep, factory = spec.partition(":")
    if not sep or not module_name or not factory:
        raise ValueError(f"--model {spec!r}: expected module:factory, e.g. examples.gpt:GPT")
    try:
        build = getattr(importlib.import_module(module_name), factory)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"--model {spec!r}: {err}") from None
    try:
        model = build()
    except TypeError as err:
        raise ValueError(f"--model {spec!r}: calling it with no arguments failed ({err}): name a factory that "
                         "takes none, e.g. a function in your code returning the model") from None
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"--model {spec!r} returned a {type(model).__name__}, not a torch.nn.Module: name a "
                         "factory that returns the model")
    params = list(model.parameters())  # a tied weight is listed once
    return (sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params if not p.requires_grad))


def format_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)
