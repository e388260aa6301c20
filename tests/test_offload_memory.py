"""With `offload_optimizer.device: nvme`, host memory for optimizer state is the swap pool, not the state:
in training while the model grows 4x, and in a checkpoint save and load (engine/checkpoint/nvme.py).

Measured, not assumed: the training processes' RSS (psutil) and the kernel's peak RSS (VmHWM, reset
through /proc/self/clear_refs) around what is measured. The same measurement with
`offload_optimizer.device: cpu`, whose AdamW state is in host memory, shows that it sees optimizer
state when there is some (8 bytes per partition element).
[Note: glibc] Freed transients (sub-group chunks, the first step's state) would otherwise stay in glibc's
heap once its mmap threshold has risen, and RSS would show the allocator's cache, not the code: each
rank fixes the threshold with `mallopt(M_MMAP_THRESHOLD)` first (what MALLOC_MMAP_THRESHOLD_ does, but
the environment variable is read only at process start, and a rank forked from the harness's
forkserver started long before: measured, the variable then had no effect and the test saw 9 MiB).
offload/host_heap.py does the same (at the same 256 KiB) only where parameters are swapped to NVMe
(its third note), so the ranks here, which swap the optimizer alone or build CPU-offload engines,
fix it themselves.
"""
from __future__ import annotations

import gc
import os

import pytest
import torch

import engine
from engine.checkpoint.blockio import BLOCK
from tests.harness import run_distributed

SUB_GROUP = 65_536  # elements: a chunk of AdamW's master + 2 moments is 768 KiB
MARGIN = 4 * 2**20  # a few sub-groups' chunks (768 KiB each), pickling, interpreter noise
MiB = 2**20
# Module note: settle. The step's last all-gather writes into a full-size buffer that the step frees after
# `wait()`; gloo's worker thread drops its own reference to the finished work (and so to the buffer) a
# moment later. On this 2-core machine that moment was sometimes after the measurement: the "held" figure
# then showed the gathered weight (9 MiB at width 1536, 2.25 MiB at 768; a smaller part while the other
# core unmapped it), in about 1 of 80 steps, and a reading a few ms later did not (CI failed on it once).
# Memory still held after 10 ms with the main thread idle is what the test is about.
SETTLE_S, SETTLE_BYTES = 0.01, 64 * 1024


class Wide(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.l1 = torch.nn.Linear(width, width, bias=False)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.l1(x), y)


def _config(device: str, nvme_path: str, async_save: bool = False) -> dict:
    zero = {"stage": 2, "offload_optimizer": {"device": device}}
    if device == "nvme":  # sub_group_size is read by the NVMe tier only (and refused without it)
        zero.update(sub_group_size=SUB_GROUP, offload_optimizer={"device": device, "nvme_path": nvme_path})
    return {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": zero,
            "checkpoint": {"async_save": async_save}}


def _engine(width: int, device: str, nvme_path: str, async_save: bool = False):
    torch.manual_seed(0)
    eng, _, _, _ = engine.initialize(model=Wide(width), config=_config(device, nvme_path, async_save))
    return eng


def _step(eng, width: int) -> None:
    x = torch.randn(2, width, device="cpu")
    eng.backward(eng(x, x))
    eng.step()


def _rss() -> int:
    import psutil
    return psutil.Process().memory_info().rss


def _trimmed_rss() -> int:
    """RSS of what stays live: after a garbage collection and after glibc has returned the free memory of
    every arena (malloc_trim), not what cyclic garbage or the allocator happens to hold; read until two
    readings SETTLE_S apart agree (module note: settle)."""
    import ctypes
    import time
    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)
    last = _rss()
    for _ in range(50):
        time.sleep(SETTLE_S)
        now = _rss()
        if abs(now - last) < SETTLE_BYTES:
            return now
        last = now
    return last


def _peak_growth(fn) -> tuple[int, object]:
    """(peak RSS during fn() minus RSS before it, fn's result)."""
    base = _rss()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the kernel's peak RSS (VmHWM) restarts at the current RSS
    out = fn()
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    return peak - base, out


def _fix_mmap_threshold() -> None:
    """Module note: glibc. Allocations from 256 KiB up get their own mapping, returned when freed."""
    import ctypes
    m_mmap_threshold = -3  # malloc.h
    assert ctypes.CDLL(None).mallopt(m_mmap_threshold, 256 * 1024) == 1


# -- training: the state's host memory while the model grows 4x --------------------------------------
WIDTHS = (768, 1536)  # 0.6M and 2.4M parameters: 0.3M and 1.2M partition elements per rank
HELD_MARGIN = 3 * 2**20  # the first steps' per-sub-group transients and interpreter noise


# -- ZeRO-3, parameters and optimizer on NVMe: the build and the gradients while the model grows 4x ------
STACK_WIDTH, STACK_DEPTHS = 512, (8, 32)  # 2.1M and 8.4M parameters: 1M and 4.2M partition elements per rank
# Above the pools: a layer's chunk, gathered weights and gradient (1 MiB each), the gradient landings
# in flight (grad_swap.DEPTH of a layer's 0.5 MiB segment), the global norm's read (NORM_CHUNK: 4 MiB),
# the initial weights' broadcast (build.py's BROADCAST_NUMEL: 4 MiB), interpreter noise. The large
# model's fp32 partition (16 MiB) and its full gradient (32 MiB, held in the first backward) are more.
STACK_MARGIN = 12 * 2**20  # measured 9-11 MiB in training at both depths, with other jobs on the machine


class Stack(torch.nn.Module):
    def __init__(self, depth: int):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(STACK_WIDTH, STACK_WIDTH, bias=False) for _ in range(depth))

    def forward(self, x, y):
        for layer in self.layers:
            x = layer(x)
        return torch.nn.functional.mse_loss(x, y)


def _stage2_nvme_config(nvme_path: str) -> dict:
    """The stage-3 config's optimizer side at stage 2: the gradient partition in swap files (grad_swap.py)."""
    layer = STACK_WIDTH * STACK_WIDTH
    return {"train_batch_size": 4, "gradient_accumulation_steps": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            # all-gather buckets of a layer too: the default is GATHER_BUCKET_CAP (16 MiB, 2 in flight)
            "zero_optimization": {"stage": 2, "sub_group_size": SUB_GROUP, "reduce_bucket_size": layer,
                                  "allgather_bucket_size": layer,
                                  "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 3,
                                                        "swap_gradients": True}}}


def _stage2_nvme_peaks(nvme_path: str, depth: int) -> dict:
    """Peak RSS growth of initialize (the model built before the baseline) and of one step of 2
    micro-steps (the first reducing backward holds every full gradient: arrivals.py) at stage 2."""
    torch.manual_seed(0)
    model = Stack(depth)
    gc.collect()
    build_peak, eng = _peak_growth(lambda: engine.initialize(model=model, config=_stage2_nvme_config(nvme_path))[0])
    zopt, x = eng.zero_optimizer, torch.randn(1, STACK_WIDTH, device="cpu")

    def train():
        for _ in range(2):
            eng.backward(eng(x, x))
            eng.step()
    gc.collect()
    train_peak, _ = _peak_growth(train)
    out = {"build": build_peak, "train": train_peak, "numel": sum(f.numel() for f in zopt.partition.flat.values()),
           "pools": zopt.nvme.pool.nbytes, "swapped": zopt.grad_swap is not None,
           "grad_host_bytes": zopt.partition.num_bytes()["master_grad"]}
    eng.destroy()
    return out


def _stage3_nvme_config(nvme_path: str) -> dict:
    nvme = {"device": "nvme", "nvme_path": nvme_path}
    layer = STACK_WIDTH * STACK_WIDTH
    return {"train_batch_size": 4, "gradient_accumulation_steps": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {
                "stage": 3, "sub_group_size": SUB_GROUP, "reduce_bucket_size": layer,
                # about one layer gathered at a time: what is live does not grow with the depth
                "stage3_max_live_parameters": layer, "stage3_max_reuse_distance": 0,
                "stage3_prefetch_bucket_size": layer, "stage3_param_persistence_threshold": 0,
                "offload_optimizer": {**nvme, "buffer_count": 3},
                "offload_param": {**nvme, "buffer_count": 2, "buffer_size": layer // 2, "max_in_cpu": 0}}}


def _stage3_nvme_peaks(nvme_path: str, depth: int, zero_init: bool = True, steps: int = 1) -> dict:
    """Peak RSS growth of building the engine (zero.Init(remote_device="nvme") + initialize, or initialize
    of a model built in memory before the baseline), of `steps` steps of 2 micro-steps, and of a save."""
    cfg = _stage3_nvme_config(nvme_path)
    torch.manual_seed(0)
    model = None if zero_init else Stack(depth)

    def build():
        if model is not None:
            return engine.initialize(model=model, config=cfg)[0]
        with engine.zero.Init(remote_device="nvme", config_dict_or_path=cfg):
            built = Stack(depth)
        return engine.initialize(model=built, config=cfg)[0]
    gc.collect()
    build_peak, eng = _peak_growth(build)
    del model
    zopt = eng.zero_optimizer
    x = torch.randn(1, STACK_WIDTH, device="cpu")

    def train():
        for _ in range(2 * steps):
            eng.backward(eng(x, x))
            eng.step()
    gc.collect()
    train_peak, _ = _peak_growth(train)
    gc.collect()  # a checkpoint save streams the swap files (the fp32 rows too: engine/checkpoint/nvme.py)
    save_peak = _peak_growth(lambda: eng.save_checkpoint(os.path.join(nvme_path, "ckpt"), tag=f"depth{depth}"))[0]         if steps else 0
    out = {"build": build_peak, "train": train_peak, "save": save_peak, "numel": sum(f.numel() for f in zopt.partition.flat.values()),
           "pools": zopt.nvme.pool.nbytes + zopt.partition.store.pool.nbytes, "swapped": zopt.grad_swap is not None,
           "grad_host_bytes": zopt.model_state_bytes()["partition_grad"]}
    eng.destroy()
    return out


def _held_by_stepping(nvme_path: str) -> dict:
    _fix_mmap_threshold()
    warm = _engine(64, "nvme", nvme_path)  # one-time costs of the first NVMe engine (lazy imports, I/O threads)
    for _ in range(2):
        _step(warm, 64)
    warm.destroy()
    out = {}
    for device in ("cpu", "nvme"):
        for width in WIDTHS:
            eng = _engine(width, device, nvme_path)
            x = torch.randn(2, width, device="cpu")
            eng.backward(eng(x, x))  # gradients, buckets and host flats exist before the baseline
            gc.collect()  # the previous engine's cycles are freed now, not during the measurement
            before = _trimmed_rss()
            eng.step()
            _step(eng, width)
            held = _trimmed_rss() - before
            numel = sum(f.numel() for f in eng.zero_optimizer.partition.flat.values())
            pool = eng.zero_optimizer.nvme.pool.nbytes if device == "nvme" else 0
            out[device, width] = {"held": held, "numel": numel, "pool": pool}
            eng.destroy()
    _stage3_nvme_peaks(nvme_path, 2)  # the first stage-3 NVMe engine's one-time costs
    for depth in STACK_DEPTHS:
        out["stage3", depth] = _stage3_nvme_peaks(nvme_path, depth)
    out["stage3 in memory", STACK_DEPTHS[1]] = _stage3_nvme_peaks(nvme_path, STACK_DEPTHS[1], zero_init=False, steps=0)
    for depth in STACK_DEPTHS:
        out["stage2", depth] = _stage2_nvme_peaks(nvme_path, depth)
    return out


@pytest.fixture(scope="module")
def held_by_stepping(tmp_path_factory) -> list[dict]:  # one 2-rank spawn for the stage-2 and stage-3 cases
    return run_distributed(_held_by_stepping, 2, args=(os.fspath(tmp_path_factory.mktemp("held")),), timeout=180)


def test_nvme_optimizer_state_host_memory_is_the_pool_while_the_model_grows_4x(held_by_stepping):
    results = [{k: v for k, v in r.items() if not k[0].startswith("stage")} for r in held_by_stepping]
    print([{f"{k[0]}-{k[1]}": round(v["held"] / MiB, 2) for k, v in r.items()} for r in results])  # MiB, with -s
    for rank, r in enumerate(results):
        small, large = r["nvme", WIDTHS[0]], r["nvme", WIDTHS[1]]
        assert large["numel"] == 4 * small["numel"]
        assert small["pool"] == large["pool"] > 0, (rank, small, large)  # sub-groups, not the model, size it
        for width in WIDTHS:
            nvme = r["nvme", width]
            assert nvme["held"] <= HELD_MARGIN, f"rank {rank} width {width}: NVMe stepping holds {nvme['held'] / MiB:.1f} MiB"
        # the oracle sees in-memory state when it is there (CPU offload keeps AdamW's moments in RAM): at the
        # large size, where they are 3x the margin (at the small one, 2.3 MiB, they are within RSS noise)
        cpu = r["cpu", WIDTHS[1]]
        state = 8 * cpu["numel"]  # AdamW's two fp32 moments of this rank's partition
        assert cpu["held"] >= 0.8 * state > 2 * HELD_MARGIN, \
            f"rank {rank}: cpu {cpu['held'] / MiB:.1f} MiB held, state {state / MiB:.1f} MiB"


def test_stage3_nvme_build_and_gradients_hold_the_pools_not_the_partition_while_the_model_grows_4x(
        held_by_stepping):
    """ZeRO-3 with parameters and optimizer on NVMe: building the engine (from zero.Init's chunk files, or
    from a model in memory) fills no partition-sized host buffer, and training (gradient accumulation
    2) keeps no gradient partition in memory (engine/zero/grad_swap.py): peak RSS above the baseline
    stays within the swap pools + STACK_MARGIN while the partition grows 4x to more than the margin."""
    print({f"{k[0]}-{k[1]}": {n: round(v[n] / MiB, 1) for n in ("build", "train", "save", "pools")}
           for k, v in held_by_stepping[0].items() if k[0].startswith("stage3")})  # MiB, with -s
    for rank, r in enumerate(held_by_stepping):
        small, large = r["stage3", STACK_DEPTHS[0]], r["stage3", STACK_DEPTHS[1]]
        assert large["numel"] == 4 * small["numel"] and 4 * large["numel"] > STACK_MARGIN + large["pools"]
        assert small["pools"] == large["pools"], (rank, small, large)  # sub-groups and layers size them
        assert large["swapped"] and large["grad_host_bytes"] == 0, (rank, large)
        cases = {**{(f"zero.Init depth {d}", phase): r["stage3", d][phase] for d in STACK_DEPTHS
                    for phase in ("build", "train")},
                 ("in-memory model, depth 32", "build"): r["stage3 in memory", STACK_DEPTHS[1]]["build"]}
        for (what, phase), peak in cases.items():
            assert peak <= large["pools"] + STACK_MARGIN, \
                f"rank {rank} {what} {phase}: peak {peak / MiB:.1f} MiB, pools {large['pools'] / MiB:.1f} MiB"
        # the checkpoint's state grows by 48 MiB (fp32 rows and AdamW's moments); holding the fp32 rows, as
        # the save did before, grew its peak by 16 MiB; the writer's hashing blocks were touched by the
        # warm-up engine's save (blockio.py keeps them)
        assert large["save"] - small["save"] <= STACK_MARGIN / 2, (rank, small["save"], large["save"])
        for phase in ("build", "train"):  # the partition grows by 12 MiB; what is held must not follow it
            assert large[phase] - small[phase] <= STACK_MARGIN / 2, (rank, phase, small[phase], large[phase])


# -- checkpoints: save and load stream the swapped state ------------------------------------------------
CKPT_WIDTH = 1536  # 2.4M parameters on 1 rank: AdamW's moments are 18 MiB


ASYNC_WIDTHS = (768, 1536)  # 0.6M and 2.4M parameters: master + AdamW's moments 7 and 28 MiB


def _async_save_peak(ckpt: str, nvme_path: str, width: int) -> dict:
    """Peak RSS added by an async save, the background writer's work included (until it committed)."""
    eng = _engine(width, "nvme", nvme_path, async_save=True)
    _step(eng, width)
    gc.collect()

    def save_and_commit():
        eng.save_checkpoint(ckpt, tag=f"async{width}")
        eng.wait_for_checkpoint()
    peak, _ = _peak_growth(save_and_commit)
    numel = sum(f.numel() for f in eng.zero_optimizer.partition.flat.values())
    eng.destroy()
    return {"peak": peak, "state": 12 * numel}  # fp32 master + 2 moments: what the save reads


def _checkpoint_peaks(ckpt: str, nvme_path: str) -> dict:
    _fix_mmap_threshold()
    saver = _engine(CKPT_WIDTH, "nvme", nvme_path)
    _step(saver, CKPT_WIDTH)
    # The first save also pays one-time costs: the writer's hashing blocks, and the code pages of the
    # libraries it runs first (file-backed, faulted in by each forked rank: 2-4 MiB, depending on what the
    # rank's parent had imported). The second save shows what a save holds.
    first_peak, _ = _peak_growth(lambda: saver.save_checkpoint(ckpt, tag="first"))
    _step(saver, CKPT_WIDTH)
    save_peak, _ = _peak_growth(lambda: saver.save_checkpoint(ckpt, tag="t"))
    saver.destroy()
    loader = _engine(CKPT_WIDTH, "nvme", nvme_path)
    load_peak, _ = _peak_growth(lambda: loader.load_checkpoint(ckpt, tag="t"))
    numel = sum(f.numel() for f in loader.zero_optimizer.partition.flat.values())
    loader.destroy()
    return {"first save": first_peak, "save": save_peak, "load": load_peak, "state": 8 * numel,
            "file": os.path.getsize(os.path.join(ckpt, "t", "rank_00000.pt")),
            "async": {width: _async_save_peak(ckpt, nvme_path, width) for width in ASYNC_WIDTHS}}


@pytest.fixture(scope="module")
def checkpoint_peaks(tmp_path_factory) -> dict:  # one 1-rank spawn for the sync and the async cases
    d = tmp_path_factory.mktemp("offload_memory_ckpt")
    return run_distributed(_checkpoint_peaks, 1, args=(os.fspath(d / "ckpt"), os.fspath(d)), timeout=180)[0]


def test_nvme_checkpoint_save_and_load_stream_the_state(checkpoint_peaks):
    r = {k: v for k, v in checkpoint_peaks.items() if k != "async"}
    print({k: round(v / MiB, 2) for k, v in r.items()})  # MiB, shown with -s
    assert r["state"] > 3 * MARGIN  # assembling it, as the save did before it streamed, would show
    # Fixed costs named: on the first save the writer's 3 hashing blocks (blockio.py, kept for the next
    # save) and code pages (above); at load the rank file's pages,
    # memory-mapped by torch.load (page cache, the same for any load), or before them the verification's
    # two read buffers (freed when it ends).
    assert r["first save"] <= 3 * BLOCK + 2 * MARGIN, \
        f"first save peak {r['first save'] / MiB:.1f} MiB (state {r['state'] / MiB:.0f} MiB)"
    assert r["save"] <= MARGIN, f"save peak {r['save'] / MiB:.1f} MiB (state {r['state'] / MiB:.0f} MiB)"
    assert r["load"] <= max(r["file"], 2 * BLOCK) + MARGIN, \
        f"load peak {r['load'] / MiB:.1f} MiB, file {r['file'] / MiB:.1f} MiB (state {r['state'] / MiB:.0f} MiB)"


def test_nvme_async_save_memory_stays_bounded_while_the_model_grows_4x(checkpoint_peaks):
    """The async save's snapshot is a copy of the swap files (engine/checkpoint/nvme.py's note: async
    save), so what it adds to RSS is a few sub-groups, not the state. The writer's hashing blocks are
    not counted: blockio.py keeps them from file to file, resident since the synchronous save above."""
    small, large = (checkpoint_peaks["async"][w] for w in ASYNC_WIDTHS)
    print({w: round(checkpoint_peaks["async"][w]["peak"] / MiB, 2) for w in ASYNC_WIDTHS})  # MiB, with -s
    assert large["state"] == 4 * small["state"]
    # the oracle: snapshotting the moments (8 of the 12 bytes) into memory, as before, would add 3x the
    # bound at the large size, and grow by as much from the small size to the large one
    assert 8 / 12 * large["state"] > 3 * MARGIN and 8 / 12 * (large["state"] - small["state"]) > 3 * MARGIN
    for w, r in zip(ASYNC_WIDTHS, (small, large)):
        assert r["peak"] <= MARGIN, f"width {w}: async save peak {r['peak'] / MiB:.1f} MiB (state {r['state'] / MiB:.0f} MiB)"
    assert large["peak"] - small["peak"] <= MARGIN / 2, \
        f"async save peak grew {(large['peak'] - small['peak']) / MiB:.1f} MiB as the model grew 4x"


def test_stage2_nvme_gradients_hold_no_partition_while_the_model_grows_4x(held_by_stepping):
    """ZeRO-2 with the optimizer on NVMe keeps its gradient partition in swap files (grad_swap.py): the
    build allocates no gradient flat, and training (gradient accumulation 2, the first backward holding
    every full gradient in a file too) stays within the pool + STACK_MARGIN while the partition grows 4x.
    What stage 2 still holds by design is the fp32 send image of the all-gather (4 bytes per partition
    element, built at initialize): the build's bound counts it, and only it, as growing with the model."""
    print({f"{k[0]}-{k[1]}": {n: round(v[n] / MiB, 1) for n in ("build", "train", "pools")}
           for k, v in held_by_stepping[0].items() if k[0] == "stage2"})  # MiB, with -s
    for rank, r in enumerate(held_by_stepping):
        small, large = r["stage2", STACK_DEPTHS[0]], r["stage2", STACK_DEPTHS[1]]
        assert large["numel"] == 4 * small["numel"] and 4 * large["numel"] > STACK_MARGIN + large["pools"]
        assert small["pools"] == large["pools"] and large["swapped"] and large["grad_host_bytes"] == 0, (rank, large)
        send_image = 4 * (large["numel"] - small["numel"])  # the host flat: 12 MiB more at the large size
        assert large["build"] - small["build"] <= send_image + STACK_MARGIN / 2, (rank, small["build"], large["build"])
        # the gradient partition (4 B/element) would grow the build by another 12 MiB, the first
        # backward's full gradients (32 MiB at the large size) the training peak
        assert large["train"] <= large["pools"] + STACK_MARGIN, (rank, large["train"] / MiB, large["pools"] / MiB)
        assert large["train"] - small["train"] <= STACK_MARGIN / 2, (rank, small["train"], large["train"])
