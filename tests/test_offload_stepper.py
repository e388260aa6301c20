"""`SwappedPartition` (offload/swapped_partition.py): an optimizer stepped over swap files in sub-groups
is the in-memory optimizer, bit for bit, and holds only its pool in host memory.

Reference: the same torch optimizer over the whole flat tensor in memory. Checked after 10 steps:
master weights (as handed to `on_updated`) and every state tensor, exactly, for fused AdamW and for SGD
with momentum (whose update is linear in the gradient, so a wrong slice or offset shows), with
sub_group_size smaller than, equal to, larger than and not dividing the partition, with and without
pipelined reads and writes. A step that fails halfway leaves the files bit for bit unchanged; state
streamed out by `state_chunks` loads at other boundaries; the RSS bound is measured in a subprocess.
Deferred initialisation (`fast_init`) writes no file and steps as the written one does; a file-level
snapshot (`frozen`, async checkpoints) reads back the state it was taken at, after more steps.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from offload import AsyncFileIO, SwapBufferPool, SwapDir, SwappedPartition, sub_group_buffer_elements
from offload.aio import OffloadIOError
from offload.swapped_partition import MASTER
from offload.estimate import EstimateSettings, estimate_memory
from schemas.features import AioConfig

KEY = "zero_optimization.offload_optimizer.nvme_path"
NUMEL = 5000
STEPS = 10
OPTIMIZERS = {
    "adamw-fused": lambda params: torch.optim.AdamW(params, lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1, fused=True),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True),
}


class Swapped:
    """A SwappedPartition with its directory, I/O engine and pool, and the flat the engine would hold."""

    def __init__(self, root, make, numel, sub_group, pipeline=(False, False), buffers=9, slots=2):
        self.swap = SwapDir.create(root, path_key=KEY)
        self.io = AsyncFileIO(AioConfig(block_size=4096, intra_op_parallelism=2), path_key=KEY)
        self.pool = SwapBufferPool(buffers, sub_group_buffer_elements(numel, sub_group))
        self.part = SwappedPartition(numel, make, self.swap, self.io, self.pool, sub_group, *pipeline, slots=slots)
        self.model = torch.full((numel,), float("nan"), device="cpu")

    def step(self, grad):
        self.part.step(lambda s, e: grad[s:e], lambda s, e, master: self.model[s:e].copy_(master))

    def files_digest(self) -> dict:
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(self.swap.path.glob("*.swp"))}

    def close(self):
        self.part.close()
        self.io.close()
        self.swap.close()


def reference(make, master, grads):
    param = torch.nn.Parameter(master.clone())
    optimizer = make([param])
    for grad in grads:
        param.grad = grad.clone()
        optimizer.step()
    return param.detach(), optimizer.state[param]


def data(steps=STEPS, numel=NUMEL, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=gen), [torch.randn(numel, generator=gen) for _ in range(steps)]


def assert_state_equal(part: SwappedPartition, want_state: dict):
    seen = 0
    for chunk in part.state_chunks():
        s, e = chunk["start"], chunk["end"]
        assert seen == s
        seen = e
        for key, value in chunk["state"].items():
            assert torch.equal(value, want_state[key][s:e]), (key, s, e)
        for key, value in chunk["scalars"].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(want_state[key])), key
    assert seen == part.numel


def steps_on_exactly(swapped: Swapped, grads, want: torch.Tensor, want_state: dict) -> None:
    """`swapped` takes these steps and ends where the in-memory optimizer did, weights and state."""
    for grad in grads:
        swapped.step(grad)
    assert torch.equal(swapped.model, want)
    assert_state_equal(swapped.part, want_state)


@pytest.mark.parametrize("pipeline", [(False, False), (True, True)], ids=["sequential", "pipelined"])
@pytest.mark.parametrize("sub_group", [1000, 1536, NUMEL, 8192], ids=["divides", "not-dividing", "equal", "larger"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_equals_in_memory_optimizer_bit_for_bit(tmp_path, name, sub_group, pipeline):
    make = OPTIMIZERS[name]
    master, grads = data()
    want, want_state = reference(make, master, grads)
    swapped = Swapped(tmp_path, make, NUMEL, sub_group, pipeline)
    try:
        swapped.part.initialize(lambda s, e: master[s:e])
        for grad in grads:
            swapped.step(grad)
        assert torch.equal(swapped.model, want)
        assert_state_equal(swapped.part, want_state)
        assert set(want_state) == set(swapped.part.state_keys) | set(swapped.part.scalar_keys)
    finally:
        swapped.close()
    assert not list(tmp_path.iterdir())  # close() left no swap file or directory behind


def test_failed_step_leaves_files_unchanged_and_training_continues_exactly(tmp_path):
    make = OPTIMIZERS["adamw-fused"]
    master, grads = data(steps=4)
    want, want_state = reference(make, master, grads)  # the failed step never happened
    swapped = Swapped(tmp_path, make, NUMEL, 1000, pipeline=(True, True))
    try:
        swapped.part.initialize(lambda s, e: master[s:e])
        for grad in grads[:2]:
            swapped.step(grad)
        before = [{k: v.clone() if torch.is_tensor(v) else v for k, v in c.items()} for c in swapped.part.state_chunks()]
        live_slot = {n: d for n, d in swapped.files_digest().items() if n.endswith(f".{swapped.part._slot}.swp")}

        def bad_grad(s, e):
            if s >= 3000:  # sub-groups 0-2 are stepped and written before this one fails
                raise RuntimeError("gradient unavailable")
            return torch.full((e - s,), float("nan"))
        with pytest.raises(RuntimeError, match="gradient unavailable"):
            swapped.part.step(bad_grad)
        after = swapped.files_digest()
        assert all(after[n] == d for n, d in live_slot.items())  # bit for bit
        for old, new in zip(before, swapped.part.state_chunks()):
            assert torch.equal(old["master"], new["master"])
            assert all(torch.equal(old["state"][k], new["state"][k]) for k in old["state"])
        for grad in grads[2:]:
            swapped.step(grad)
        assert torch.equal(swapped.model, want)
        assert_state_equal(swapped.part, want_state)
    finally:
        swapped.close()


def test_one_slot_steps_in_place_and_refuses_the_state_a_failed_step_left(tmp_path):
    """swap_slots 1: half the files, the same bits as in memory (pipelined, so the write of sub-group
    k-1 and the read of k+1 are in flight around k's step); after a step that failed halfway, the next
    step and a checkpoint's read are refused, naming the file; a loaded state steps on exactly."""
    make = OPTIMIZERS["adamw-fused"]
    master, grads = data(steps=4)
    want, want_state = reference(make, master, grads)
    (tmp_path / "one").mkdir(), (tmp_path / "two").mkdir()
    one = Swapped(tmp_path / "one", make, NUMEL, 1000, pipeline=(True, True), slots=1)
    two = Swapped(tmp_path / "two", make, NUMEL, 1000, pipeline=(True, True))
    try:
        for swapped in (one, two):
            swapped.part.initialize(lambda s, e: master[s:e])
            for grad in grads[:2]:
                swapped.step(grad)
        assert len(one.part.paths) * 2 == len(two.part.paths) == 6
        assert sum(map(os.path.getsize, one.part.paths)) * 2 == sum(map(os.path.getsize, two.part.paths))
        saved = [{k: v.clone() if torch.is_tensor(v) else v for k, v in c.items()} for c in one.part.state_chunks()]

        def bad_grad(s, e):
            if s >= 3000:  # sub-groups 0-2 are written in place before this one fails
                raise RuntimeError("gradient unavailable")
            return grads[2][s:e]
        with pytest.raises(RuntimeError, match="gradient unavailable"):
            one.part.step(bad_grad)
        for refused in (lambda: one.step(grads[2]), lambda: next(one.part.state_chunks())):
            with pytest.raises(OffloadIOError, match=r"master\.0\.swp: the optimizer state .* partly overwritten"
                                                     r".*load a checkpoint.*swap_slots: 2"):
                refused()
        one.part.load_chunks(iter(saved))  # the checkpoint taken before the failure
        for grad in grads[2:]:
            one.step(grad)
            two.step(grad)
        for swapped in (one, two):
            assert torch.equal(swapped.model, want)
            assert_state_equal(swapped.part, want_state)
    finally:
        one.close()
        two.close()


def test_state_streams_out_and_loads_at_other_boundaries(tmp_path):
    make = OPTIMIZERS["adamw-fused"]
    master, grads = data(steps=6)
    want, want_state = reference(make, master, grads)
    first = Swapped(tmp_path, make, NUMEL, 1000)
    second = Swapped(tmp_path, make, NUMEL, 1536, pipeline=(True, False))
    try:
        first.part.initialize(lambda s, e: master[s:e])
        for grad in grads[:3]:
            first.step(grad)

        def recut(chunks):  # cut every chunk in two: boundaries the loader has never seen
            for c in chunks:
                mid = (c["start"] + c["end"]) // 2
                for lo, hi in ((c["start"], mid), (mid, c["end"])):
                    a, b = lo - c["start"], hi - c["start"]
                    yield {"start": lo, "end": hi, "master": c["master"][a:b], "scalars": c["scalars"],
                           "state": {k: v[a:b] for k, v in c["state"].items()}}
        second.part.load_chunks(recut(first.part.state_chunks()))
        steps_on_exactly(second, grads[3:], want, want_state)
    finally:
        first.close()
        second.close()


def test_load_master_replaces_the_weights_and_keeps_the_state(tmp_path):
    """A load of the weights alone (a checkpoint loaded with load_optimizer_states=False): in memory the
    optimizer's state is kept and only the parameter changes; `load_master` does that to the files, from
    chunks cut at boundaries the partition has never seen. (`load_chunks` of such chunks drops the state.)"""
    make = OPTIMIZERS["adamw-fused"]
    master, grads = data(steps=6)
    loaded = torch.randn(NUMEL, generator=torch.Generator().manual_seed(1))
    param = torch.nn.Parameter(master.clone())
    optimizer = make([param])
    for k, grad in enumerate(grads):
        if k == 3:
            param.data.copy_(loaded)
        param.grad = grad.clone()
        optimizer.step()
    swapped = Swapped(tmp_path, make, NUMEL, 1000, pipeline=(True, True))
    try:
        swapped.part.initialize(lambda s, e: master[s:e])
        for grad in grads[:3]:
            swapped.step(grad)
        swapped.part.load_master({"start": s, "end": min(s + 1536, NUMEL), "master": loaded[s:s + 1536],
                                  "state": {}, "scalars": {}} for s in range(0, NUMEL, 1536))
        for grad in grads[3:]:
            swapped.step(grad)
        assert torch.equal(swapped.model, param.detach())
        assert_state_equal(swapped.part, optimizer.state[param])
    finally:
        swapped.close()


def test_one_slot_load_reads_the_master_ranges_it_has_not_written_yet(tmp_path):
    """A checkpoint load with the master in the files only (stages 1-2 in 16-bit training: the 16-bit
    send image, engine/zero/partition_store.py) reads each sub-group's committed master just before
    `load_chunks` writes it. In place (slots=1) the ranges not yet written are still the committed state:
    the reads are not refused, and the loaded run steps on exactly."""
    make = OPTIMIZERS["adamw-fused"]
    master, grads = data(steps=6)
    want, want_state = reference(make, master, grads)
    first = Swapped(tmp_path, make, NUMEL, 1000)
    second = Swapped(tmp_path, make, NUMEL, 1000, pipeline=(True, True), buffers=12, slots=1)
    try:
        first.part.initialize(lambda s, e: master[s:e])
        second.part.initialize(lambda s, e: torch.zeros(e - s))
        for grad in grads[:3]:
            first.step(grad)
            second.step(grad)  # state of its own, which the load replaces

        def reading(chunks):  # as engine/checkpoint/nvme.py's _chunks: the target's master, then the rows
            for c in chunks:
                if c["start"] > 0:  # what the load wrote already is no committed state: still refused
                    with pytest.raises(OffloadIOError, match="partly overwritten"):
                        second.part.read_master(c["start"] - 1, c["start"])
                base = second.part.read_master(c["start"], c["end"])
                base.copy_(c["master"])
                yield {**c, "master": base}
        second.part.load_chunks(reading(first.part.state_chunks()))
        steps_on_exactly(second, grads[3:], want, want_state)
    finally:
        first.close()
        second.close()


def _frozen_rows(frozen, kind: str, numel: int) -> torch.Tensor:
    return torch.cat(list(frozen.rows(kind, 0, numel)))


def test_deferred_initialisation_and_frozen_snapshots(tmp_path):
    master, grads = data(steps=4)
    make = OPTIMIZERS["sgd-momentum"]  # linear in the gradient: a wrong master or momentum moves the weights
    written, deferred = (Swapped(tmp_path, make, NUMEL, 1024, (True, True)) for _ in range(2))
    try:
        written.part.initialize(lambda s, e: master[s:e])
        source = master.clone()  # the engine's host flat: written to only by on_updated
        deferred.part.initialize(lambda s, e: source[s:e], deferred=True)
        assert written.files_digest() and not deferred.files_digest(), "fast_init wrote swap files at initialisation"
        before = deferred.part.frozen(lambda kind: str(tmp_path / f"before.{kind}"), KEY)  # no file yet: from memory
        assert before.kinds == [MASTER] and torch.equal(_frozen_rows(before, MASTER, NUMEL), master)
        deferred.model = source  # on_updated writes into the source, as the tier's host flat
        for grad in grads[:2]:
            written.step(grad)
            deferred.step(grad)
        frozen = written.part.frozen(lambda kind: str(tmp_path / f"at2.{kind}"), KEY)
        want = {chunk["start"]: chunk for chunk in written.part.state_chunks()}
        for grad in grads[2:]:  # both slots rewritten: the copies must not see it
            written.step(grad)
            deferred.step(grad)
        assert frozen.kinds == [MASTER, "momentum_buffer"]
        assert torch.equal(_frozen_rows(frozen, MASTER, NUMEL), torch.cat([c["master"] for c in want.values()]))
        assert torch.equal(_frozen_rows(frozen, "momentum_buffer", NUMEL),
                           torch.cat([c["state"]["momentum_buffer"] for c in want.values()]))
        assert torch.equal(torch.cat(list(frozen.rows(MASTER, 1000, 3000))),  # a range across sub-groups
                           torch.cat([c["master"] for c in want.values()])[1000:3000])
        frozen.close()
        before.close()
        assert not list(tmp_path.glob("at2.*")) and not list(tmp_path.glob("before.*"))
        assert torch.equal(deferred.model, written.model)
        for a, b in zip(written.part.state_chunks(), deferred.part.state_chunks()):
            assert torch.equal(a["master"], b["master"]) and torch.equal(a["state"]["momentum_buffer"],
                                                                         b["state"]["momentum_buffer"])
    finally:
        written.close()
        deferred.close()


def test_lr_set_through_param_groups_is_the_one_used(tmp_path):
    """An LR schedule writes `param_groups[i]["lr"]`; SGD's update is linear in it, so a stale lr shows."""
    make = OPTIMIZERS["sgd-momentum"]
    master, grads = data(steps=4)
    param = torch.nn.Parameter(master.clone())
    ref = make([param])
    swapped = Swapped(tmp_path, make, NUMEL, 1536, pipeline=(True, True))
    try:
        swapped.part.initialize(lambda s, e: master[s:e])
        for k, grad in enumerate(grads):
            for group in ref.param_groups + swapped.part.param_groups:
                group["lr"] = 0.1 / (k + 1)
            param.grad = grad.clone()
            ref.step()
            swapped.step(grad)
        assert torch.equal(swapped.model, param.detach())
    finally:
        swapped.close()


def test_too_few_buffers_is_a_clear_error(tmp_path):
    swap = SwapDir.create(tmp_path, path_key=KEY)
    io = AsyncFileIO(AioConfig(), path_key=KEY)
    try:
        with pytest.raises(ValueError, match="offload_optimizer.buffer_count is 2.*at least 3"):
            SwappedPartition(100, OPTIMIZERS["adamw-fused"], swap, io, SwapBufferPool(2, 1024), 100)
        with pytest.warns(UserWarning, match="pipelining wants 3"):
            part = SwappedPartition(100, OPTIMIZERS["adamw-fused"], swap, io, SwapBufferPool(6, 1024), 100, True, True)
        assert (part.pipeline_read, part.pipeline_write) == (True, False)
    finally:
        io.close()
        swap.close()


# -- bounded host memory ----------------------------------------------------------------------
SUB_GROUP = 131_072  # 512 KiB of fp32 per buffer
BUFFERS = 9  # AdamW: (master + 2 moments) x (read ahead, step, write behind)
MARGIN = 8 * 2**20  # transient: the optimizer's first-step state and a streamed chunk (1.5 MiB each here)

MEASURE = textwrap.dedent("""
    import json, sys, tempfile, threading, time
    sys.path.insert(0, {root!r})
    import psutil, torch
    torch.set_num_threads(1)
    from offload import AsyncFileIO, SwapBufferPool, SwapDir, SwappedPartition, sub_group_buffer_elements
    from schemas.features import AioConfig
    sub_group = {sub_group}
    make = lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True)

    def measure(numel, d):
        swap = SwapDir.create(d, path_key="k")
        io = AsyncFileIO(AioConfig(), path_key="k")
        before_pool = psutil.Process().memory_info().rss
        pool = SwapBufferPool({buffers}, sub_group_buffer_elements(numel, sub_group))
        pool_rss = psutil.Process().memory_info().rss - before_pool
        part = SwappedPartition(numel, make, swap, io, pool, sub_group, True, True)
        # The engine hands out views of gradients it already holds; one sub-group's worth stands in here
        # (allocating a fresh slice per call would measure glibc's heap retention, not this code).
        grad = torch.ones(sub_group, device="cpu")
        gen = lambda s, e: grad[:e - s]
        warm = SwappedPartition(sub_group, make, swap, io, pool, sub_group, True, True, name="warm-up")
        warm.initialize(gen); warm.step(gen); warm.step(gen); warm.close()  # lazy imports, I/O threads
        me = psutil.Process()
        base_rss = me.memory_info().rss
        open("/proc/self/clear_refs", "w").write("5")  # "5": the kernel's peak RSS (VmHWM) restarts here
        sampled, running = [base_rss], [True]
        def sample():  # psutil's view between the kernel's peak counter readings
            while running[0]:
                sampled.append(me.memory_info().rss); time.sleep(0.002)
        sampler = threading.Thread(target=sample); sampler.start()
        part.initialize(gen)
        for _ in range(2):
            part.step(gen)
        chunks = 0
        for c in part.state_chunks():  # one chunk alive at a time: a generator expression keeps the last
            chunks += c["master"].numel(); del c  # one while the next is cloned, doubling this transient
        running[0] = False; sampler.join()
        peak = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
        rss = me.memory_info().rss
        part.close(); io.close(); swap.close()
        return {{"held": rss - base_rss, "peak_growth": peak - base_rss, "peak_with_pool": pool_rss + peak - base_rss,
                "sampled_peak_growth": max(sampled) - base_rss, "pool": pool.nbytes, "streamed": chunks}}

    out = []
    for numel in {numels}:  # one process for every size: the pool and grad of the last are freed first
        with tempfile.TemporaryDirectory(dir={tmp!r}) as d:
            out.append(measure(numel, d))
    print(json.dumps(out))
""")


def _measure(tmp_path: Path, numels: tuple[int, ...]) -> list[dict]:
    code = MEASURE.format(root=str(Path(__file__).resolve().parents[1]), numels=list(numels), sub_group=SUB_GROUP,
                          buffers=BUFFERS, tmp=str(tmp_path))
    # [Note: glibc] Transient sub-group tensors (the optimizer's first-step state, checkpoint chunks)
    # are freed at once, but glibc raises its mmap threshold after the first such free and then keeps
    # later ones in its heap (measured: 0-50 MB retained, varying run to run, not growing with numel).
    # A fixed threshold makes RSS show what the code holds rather than what the allocator caches.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(256 * 1024)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_host_memory_bounded_by_pool_while_partition_grows_4x(tmp_path):
    small, large = _measure(tmp_path, (1_000_000, 4_000_000))
    # The 4x partition's state is 48 MB (fp32 master + 2 moments): far above the bound if it were held.
    assert large["streamed"] == 4_000_000
    for m in (small, large):  # the pool's pages were touched before the baseline was taken
        assert m["peak_growth"] <= MARGIN and m["sampled_peak_growth"] <= MARGIN and m["held"] <= MARGIN, m
    # Growth with numel beyond one sub-group's streamed chunk (master + 2 moments) is a leak; less is the
    # noise seen (CI at a8e287a: the small run's peak 2.05 MiB, the large one's 3.13; here 2.9-3.06 both):
    # whether the kernel's counters caught a transient chunk and the optimizer's first-step state together.
    assert large["peak_growth"] - small["peak_growth"] <= 3 * SUB_GROUP * 4, (small, large)
    # `dstrain estimate`'s NVMe row's pool term (its host bytes with the pool's buffers less without
    # them; the rest of the row is the gradient's landings and the send image) against the measured peak:
    def host(buffers: int) -> int:
        rows = estimate_memory(4_000_000, settings=EstimateSettings(precision="fp32", sub_group_size=SUB_GROUP,
                                                                   optimizer_buffer_count=buffers))
        return row_of(rows, 1, "nvme optimizer").host_bytes
    pool_term = host(BUFFERS) - host(0)
    assert abs(large["peak_with_pool"] - pool_term) <= 0.10 * pool_term + 6 * 2**20, (large, pool_term)


def row_of(rows, stage, offload):
    return next(r for r in rows if r.stage == stage and r.offload == offload)
