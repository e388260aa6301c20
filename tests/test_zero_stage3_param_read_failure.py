"""ZeRO-3 with parameters on NVMe: a parameter read that fails on ONE rank only (engine/zero/
stage3_read_failures.py's note). Before, that rank raised before entering the gather's all-gather and the
other rank waited in it until the process group's timeout (30 min by default) or forever; the failing
rank, going on to its next forward, issued collectives the other never matched. Now both ranks return,
at the same point: rank 1 with its own OffloadIOError (naming the swap file), rank 0 with PeerReadError
naming rank 1; the failed batch is dropped, and training on (or after a checkpoint load) equals a run
that never saw it.

Only rank 1's reads of its parameter files fail (an EIO injected at os.preadv, the aio workers' read),
in each kind of pass: the pass that records the order (request rounds, tags read at once: its forward
and its backward), a plan pass's forward and backward (`stage3_max_reuse_distance` 0: backward gathers
again), an evaluation forward, a GatheredParameters block; fp32 and bf16 parameter files, 2 ranks and
a world of one. At gradient accumulation 2 a failed backward drops the whole window on every rank. The
persistent parameters' refresh after a step: a read failing once, twice, and in two runs on different
ranks."""
from __future__ import annotations

import contextlib
import errno
import os
import time

import torch

from tests.harness import run_distributed

FAILING_RANK = 1
# 6 gather groups, 2 pool buffers: whatever buffers keep between gathers, most gathers read the files
LAYERS, BUFFERS = 6, 2
STEPS = 8
# micro-step -> where rank 1's reads fail (None: nowhere); the reference run skips these batches
FAILS = {0: "forward", 1: "backward", 3: "forward", 4: "backward"}  # 0, 1: the pass that records the order


def _engine(nvme_path: str, bf16: bool, persistent: int = 0, gas: int = 1):
    import engine
    torch.manual_seed(0)
    layers = [m for _ in range(LAYERS - 1) for m in (torch.nn.Linear(32, 32), torch.nn.Tanh())]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(32, 4))
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas, "gradient_clipping": 0.0,
           "zero_allow_untested_optimizer": True,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": persistent,
                                 "stage3_max_reuse_distance": 0,  # backward gathers again: its reads can fail
                                 "offload_optimizer": {"device": "cpu"},
                                 "offload_param": {"device": "nvme", "nvme_path": nvme_path, "max_in_cpu": 0,
                                                   "buffer_count": BUFFERS}},
           "aio": {"block_size": 4096}}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return engine.initialize(model=model, config=cfg)[0]


@contextlib.contextmanager
def _reads_fail(armed: bool):
    """Every read of this rank's parameter swap files fails (EIO), on FAILING_RANK only (rank 0 in a world
    of one), while `armed`."""
    real = os.preadv

    def preadv(fd, buffers, at):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".param.swp"):
            raise OSError(errno.EIO, "injected read error")
        return real(fd, buffers, at)
    if armed and torch.distributed.get_rank() == min(FAILING_RANK, torch.distributed.get_world_size() - 1):
        os.preadv = preadv
    try:
        yield
    finally:
        os.preadv = real


def _outcome(err: BaseException, phase: str = "") -> tuple[str, str, str]:
    return phase, type(err).__name__, str(err)


def _batches(dtype) -> list:
    g = torch.Generator().manual_seed(100 + torch.distributed.get_rank())
    return [(torch.randn(2, 32, generator=g).to(dtype), torch.randn(2, 4, generator=g).to(dtype))
            for _ in range(STEPS + 2)]


def _micro_step(eng, x, y, where: str | None) -> tuple[str, str, str] | None:
    """None, or (the call that raised, the error's type, its message)."""
    phase = "forward"
    try:
        with _reads_fail(where == "forward"):
            loss = torch.nn.functional.mse_loss(eng(x).float(), y.float())
        phase = "backward"
        with _reads_fail(where == "backward"):
            eng.backward(loss)
        phase = "step"
        eng.step()
    except RuntimeError as err:
        return _outcome(err, phase)
    return None


def _weights(eng) -> list[torch.Tensor]:
    import engine
    params = list(eng.module.parameters())
    with engine.zero.GatheredParameters(params):
        return [p.detach().float().clone() for p in params]


def _run(tmp: str, fail: bool, bf16: bool) -> dict:
    """Train STEPS micro-batches (the failing ones dropped: skipped outright by the reference, fail=False),
    an evaluation forward and a GatheredParameters block in between; then load the checkpoint saved at
    the start after one more failure (in backward) and train 2 steps."""
    import engine
    path = os.path.join(tmp, f"fail{int(fail)}")
    os.makedirs(path, exist_ok=True)
    eng = _engine(path, bf16)
    dtype = torch.bfloat16 if bf16 else torch.float32
    data = _batches(dtype)
    eng.save_checkpoint(os.path.join(path, "ckpt"), tag="start")
    out = {"errors": {}}
    for i in range(STEPS):
        if i in FAILS and not fail:
            continue
        got = _micro_step(eng, *data[i], FAILS.get(i))
        if got is not None:
            out["errors"][i] = got
        if i == 5:  # an evaluation forward, then a block, whose reads fail
            with torch.no_grad(), _reads_fail(fail):
                try:
                    eng(data[i][0])
                except RuntimeError as err:
                    out["errors"]["eval"] = _outcome(err, "forward")
            with _reads_fail(fail):
                try:
                    with engine.zero.GatheredParameters(list(eng.module.parameters())):
                        pass
                except RuntimeError as err:
                    out["errors"]["block"] = _outcome(err, "block")
    out["weights"] = _weights(eng)
    store = eng.zero_optimizer.partition.store
    out["files"], out["reads ahead"] = store.dtype, store.reads_ahead  # 16-bit files; reads ahead were met
    coord = eng.zero_optimizer.coordinator
    out["left"] = ([g.name for g in coord.groups if g.gathered], sorted(coord.pending), coord.in_pass,
                   eng.zero_optimizer.partition.store.pool.free_count())
    if fail:
        got = _micro_step(eng, *data[STEPS], "backward")
        out["errors"]["before load"] = got
    eng.load_checkpoint(os.path.join(path, "ckpt"), tag="start")
    for i in range(2):
        assert _micro_step(eng, *data[STEPS + i], None) is None
    out["loaded"] = _weights(eng)
    eng.destroy()
    return out


def _check(tmp_path, bf16: bool, world_size: int = 2) -> None:
    want = run_distributed(_run, world_size=world_size, args=(str(tmp_path), False, bf16), timeout=120)
    got = run_distributed(_run, world_size=world_size, args=(str(tmp_path), True, bf16), timeout=120)
    cases = [*FAILS, "eval", "block", "before load"]
    for rank in range(world_size):
        errors = got[rank]["errors"]
        assert sorted(map(str, errors)) == sorted(map(str, cases)), errors
        for case in cases:
            phase, kind, msg = errors[case]
            # raised where it happened, on both ranks: a forward's failure by the forward (no gradient made)
            assert phase == {"eval": "forward", "block": "block"}.get(case, FAILS.get(case, "backward")), errors[case]
            if rank == min(FAILING_RANK, world_size - 1):  # its own error, naming the swap file
                assert kind == "OffloadIOError" and ".param.swp" in msg, (case, kind, msg)
            else:
                assert kind == "PeerReadError" and f"rank {FAILING_RANK} failed to read" in msg, (case, kind, msg)
                said = {"forward": "its batch is dropped", "backward": "gradients: the step was not applied",
                        "block": "the group was not gathered"}[phase]
                assert said in msg, (case, msg)
        assert want[rank]["errors"] == {}
        assert got[rank]["files"] == (torch.bfloat16 if bf16 else torch.float32) and got[rank]["reads ahead"] > 0
        # nothing left gathered or in flight, every pool buffer back
        assert got[rank]["left"] == want[rank]["left"] == ([], [], False, BUFFERS), (got[rank]["left"], want[rank]["left"])
        for a, b in zip(got[rank]["weights"], want[rank]["weights"]):
            assert torch.equal(a, b), (a - b).abs().max()
        for a, b in zip(got[rank]["loaded"], want[rank]["loaded"]):
            assert torch.equal(a, b), (a - b).abs().max()


def test_one_rank_failing_reads_end_every_pass_together_fp32(tmp_path):
    _check(tmp_path, bf16=False)


def test_one_rank_failing_reads_end_every_pass_together_bf16(tmp_path):
    _check(tmp_path, bf16=True)


def test_a_world_of_one_raises_at_the_same_points(tmp_path):
    _check(tmp_path, bf16=False, world_size=1)


def _failing_rank_waits(tmp: str) -> tuple[str, str] | None:
    """A plan pass's forward fails on rank 1, which then runs no collective until rank 0 has returned
    (a notebook: the user reads the error): rank 0 must return on its own."""
    rank = torch.distributed.get_rank()
    path = os.path.join(tmp, "waits")
    os.makedirs(path, exist_ok=True)
    eng = _engine(path, bf16=False)
    data = _batches(torch.float32)
    for i in range(2):  # the first pass records the order; the second runs on the plan
        assert _micro_step(eng, *data[i], None) is None
    got = _micro_step(eng, *data[2], "forward")
    done = os.path.join(tmp, "rank0 returned")
    if rank == 0:
        open(done, "w").close()
    else:
        for _ in range(900):  # up to 90 s, longer than the harness waits
            if os.path.exists(done):
                break
            time.sleep(0.1)
    eng.destroy()
    return got


def test_the_other_rank_returns_while_the_failing_rank_waits(tmp_path):
    # the old code: rank 0 waited in the all-gather rank 1 never entered (the harness's timeout)
    got = run_distributed(_failing_rank_waits, world_size=2, args=(str(tmp_path),), timeout=60)
    assert got[0][:2] == ("forward", "PeerReadError") and "rank 1 failed to read its parameters" in got[0][2], got[0]
    assert got[1][:2] == ("forward", "OffloadIOError") and ".param.swp" in got[1][2], got[1]


def _persistent_refresh(tmp: str, fails: int, skip: bool = False, split: bool = False) -> dict:
    """The persistent parameters (the biases: `stage3_param_persistence_threshold` 32) are read after each
    step; on rank 1 that read fails `fails` times from step 1's on (a shim on its store: the read that
    raises OffloadIOError). Old code: rank 1 raised out of the step, rank 0 waited in the refresh's
    all-gather (the harness's timeout). `skip`: leave out batch 2 (the reference for fails=2). `split`:
    the biases gathered in two runs (as `_persistent_runs` builds one per dtype; engine.initialize casts
    the model to one dtype, so made here by hand), rank 1's read failing in the first, rank 0's in the
    second."""
    from engine.zero.partition import ChunkSpec, RankMajorLayout
    from offload.aio import OffloadIOError
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    path = os.path.join(tmp, f"persistent{fails}{skip}{split}")
    os.makedirs(path, exist_ok=True)
    eng = _engine(path, bf16=False, persistent=32)
    zopt = eng.zero_optimizer
    (failing,) = zopt.persistent_groups()
    if split:
        runs = [failing[:len(failing) // 2], failing[len(failing) // 2:]]
        zopt._persistent_layouts = [(ps, RankMajorLayout(ps + [None], [zopt.partition.fragments[p].spec for p in ps]
                                                         + [ChunkSpec(world, 1, 1)], world)) for ps in runs]
        failing = runs[1 - rank]
    store, data, out = zopt.partition.store, _batches(torch.float32), {"errors": {}}
    real, left = store.persistent_slots, [fails if split or rank == FAILING_RANK else 0]

    def persistent_slots(params):
        if left[0] and list(map(id, params)) == list(map(id, failing)):
            left[0] -= 1
            raise OffloadIOError(f"{path}: rank {rank}'s injected persistent read error")
        return real(params)
    for i in range(4):
        if i == 1:
            store.persistent_slots = persistent_slots
        if i == 2 and skip:
            continue  # the batch whose forward the failing run's second failure refuses
        got = _micro_step(eng, *data[i], None)
        if got is not None:
            out["errors"][i] = got
    out["weights"] = _weights(eng)
    eng.destroy()
    return out


def test_a_failed_persistent_refresh_is_retried_before_the_next_pass(tmp_path):
    want = run_distributed(_persistent_refresh, world_size=2, args=(str(tmp_path), 0), timeout=60)
    skipped = run_distributed(_persistent_refresh, world_size=2, args=(str(tmp_path), 0, True), timeout=60)
    once = run_distributed(_persistent_refresh, world_size=2, args=(str(tmp_path), 1), timeout=60)
    twice = run_distributed(_persistent_refresh, world_size=2, args=(str(tmp_path), 2), timeout=60)
    for rank in range(2):
        assert want[rank]["errors"] == once[rank]["errors"] == {}, once[rank]
        # once: the retry before step 2's forward reads them; every batch applied, as without the failure
        for a, b in zip(once[rank]["weights"], want[rank]["weights"]):
            assert torch.equal(a, b), (a - b).abs().max()
        # twice: step 2's forward refused on both ranks (its batch dropped), step 3's retry reads them
        (phase, kind, msg), = twice[rank]["errors"].values()
        assert 2 in twice[rank]["errors"] and phase == "forward", twice[rank]["errors"]
        if rank == FAILING_RANK:
            assert kind == "OffloadIOError" and f"rank {rank}'s injected persistent read error" in msg, msg
        else:
            assert kind == "PeerReadError" and "rank 1 failed to read its persistent parameters" in msg, msg
        for a, b in zip(twice[rank]["weights"], skipped[rank]["weights"]):
            assert torch.equal(a, b), (a - b).abs().max()


def test_each_rank_that_failed_a_persistent_run_raises_its_own_error(tmp_path):
    # two runs failing on different ranks: each rank raises its own error (before, rank 0 raised
    # PeerReadError naming rank 1, which had failed the first run, its own error lost)
    want = run_distributed(_persistent_refresh, world_size=2, args=(str(tmp_path), 0, True, True), timeout=60)
    got = run_distributed(_persistent_refresh, world_size=2, args=(str(tmp_path), 2, False, True), timeout=60)
    for rank in range(2):
        (phase, kind, msg), = got[rank]["errors"].values()
        assert 2 in got[rank]["errors"] and phase == "forward", got[rank]["errors"]
        assert kind == "OffloadIOError" and f"rank {rank}'s injected persistent read error" in msg, (rank, kind, msg)
        for a, b in zip(got[rank]["weights"], want[rank]["weights"]):
            assert torch.equal(a, b), (a - b).abs().max()


def test_a_peer_error_names_every_rank_that_failed():
    from engine.zero.stage3_read_failures import ranks_named
    assert ranks_named([1]) == "rank 1" and ranks_named([0, 2, 3]) == "ranks 0, 2, 3"


def _window(tmp: str, fail: bool) -> dict:
    """Gradient accumulation 2: the window's second backward fails on rank 1 (micro-batch 1); the window is
    dropped on every rank, micro-batch 0 with it (docs/offload.md), so the next micro-batch (2) ends a
    window of its own. The reference (fail=False) runs micro-batch 0 with its loss times 0 (zero
    gradients) and then 2: the same window. Then both load the checkpoint saved at the start and train
    two windows (3-6): an exact continuation."""
    import engine  # noqa: F401 - the engine's import, as in every rank here
    path = os.path.join(tmp, f"window{int(fail)}")
    os.makedirs(path, exist_ok=True)
    eng = _engine(path, bf16=False, gas=2)
    data, out = _batches(torch.float32), {"errors": {}}
    eng.save_checkpoint(os.path.join(path, "ckpt"), tag="start")
    for i in (0, 1, 2) if fail else (0, 2):
        x, y = data[i]
        scale = 0.0 if i == 0 and not fail else 1.0
        try:
            loss = torch.nn.functional.mse_loss(eng(x), y) * scale
            with _reads_fail(fail and i == 1):
                eng.backward(loss)
            eng.step()
        except RuntimeError as err:
            out["errors"][i] = _outcome(err, "backward")
    out["window"] = _weights(eng)
    coord = eng.zero_optimizer.coordinator
    out["left"] = ([g.name for g in coord.groups if g.gathered], sorted(coord.pending), coord.in_pass,
                   eng.zero_optimizer.partition.store.pool.free_count())
    eng.load_checkpoint(os.path.join(path, "ckpt"), tag="start")
    for i in range(3, 7):
        assert _micro_step(eng, *data[i], None) is None
    out["loaded"] = _weights(eng)
    eng.destroy()
    return out


def test_a_failed_backward_drops_the_whole_accumulation_window_on_every_rank(tmp_path):
    want = run_distributed(_window, world_size=2, args=(str(tmp_path), False), timeout=60)
    got = run_distributed(_window, world_size=2, args=(str(tmp_path), True), timeout=60)
    for rank in range(2):
        assert want[rank]["errors"] == {}
        (phase, kind, msg), = got[rank]["errors"].values()
        assert 1 in got[rank]["errors"], got[rank]["errors"]
        if rank == FAILING_RANK:
            assert kind == "OffloadIOError" and ".param.swp" in msg, msg
        else:
            assert kind == "PeerReadError" and "dropped this accumulation window's gradients" in msg, msg
        assert got[rank]["left"] == ([], [], False, BUFFERS), got[rank]["left"]
        for key in ("window", "loaded"):
            for a, b in zip(got[rank][key], want[rank][key]):
                assert torch.equal(a, b), (key, (a - b).abs().max())
