"""A failed NVMe optimizer step whose send image cannot be put back (engine/zero/nvme_tier.py's
`_restore_send_image`): the next step refuses to run until a checkpoint is loaded.

A step that fails halfway leaves the swap files' committed state as it was (two slots), but the sub-
groups stepped before the failure already updated the host flat: the send image the gathers read as
weights and, since the step copies its master from there (swapped_partition.py's note: master copy),
what the next step would start from. The tier puts the committed master back; when that fails too
(here: the master's read raises), training on would step from half-updated weights without a word, so
the next step is refused with a one-line error naming the key, and a checkpoint load (which rewrites the
flat from the loaded master) lets training go on, equal bit for bit to a run that never failed. The
checkpoint loaded is one saved after the failure: its fp32 rows come from the committed master in the
swap files, not from the half-updated flat (engine/checkpoint/nvme.py; before, training on from it differed
from the run without the failure by up to 0.023 in a weight).

At stage 3 the half-updated image is also what the forward, `GatheredParameters` and `safe_get_*` read
(the host flats, or the NVMe parameter store's resident copies and kept buffers): each is refused with
the same error until the load (engine/zero/partition_store.py's note: a refused image), a checkpoint or
a training state dict taken before the failure. Before, they served the half-updated weights while only
the step refused. Where one rank alone refuses, each of those reads ends on every rank together
(safe_get_full_fp32_param agrees first: before, the other ranks waited in its all-gather).
"""
from __future__ import annotations

import torch

from tests.harness import run_distributed


def _fail_after_first_sub_group(tier, part) -> None:
    """The step's gradient reads fail after its first sub-group, and the master's reads (the restore's)
    fail: a half-step whose send image cannot be put back. `del tier.grad_reader, part.read_master`
    brings the disk back."""
    assert len(part.groups) > 2, part.groups  # a failure after the first sub-group leaves a half-step
    reader = tier.grad_reader

    def failing_reader(k):
        read = reader(k)

        def read_or_fail(s, e):
            if s >= part.groups[1][0]:
                raise RuntimeError("gradient read failed")
            return read(s, e)
        return read_or_fail

    def failing_master(s, e):
        raise OSError("master read failed")
    tier.grad_reader, part.read_master = failing_reader, failing_master


def _steps(nvme_path: str, ckpt: str) -> dict:
    import engine
    from engine.utils import safe_get_full_fp32_param
    from tests.models import OddMLP, make_batches, micro_batches
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    batches = make_batches(3, 4 * world)

    def build():
        torch.manual_seed(0)
        return engine.initialize(model=OddMLP(), config={
            "train_batch_size": 4 * world, "gradient_clipping": 0, "zero_allow_untested_optimizer": True,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
            "zero_optimization": {"stage": 2, "sub_group_size": 64, "offload_optimizer": {
                "device": "nvme", "nvme_path": nvme_path, "buffer_count": 6}}})[0]

    def train(eng, batch):
        (xm, ym), = micro_batches(*batch, rank, world, 1)
        eng.backward(eng(xm, ym))
        eng.step()

    def weights(eng):
        return {n: safe_get_full_fp32_param(p) for n, p in eng.module.named_parameters() if p.requires_grad}

    ref = build()
    for batch in batches:
        train(ref, batch)
    want = weights(ref)
    ref.destroy()

    eng = build()
    out = {}
    for batch in batches[:2]:
        train(eng, batch)
    tier = eng.zero_optimizer.nvme
    (key, part), = tier.parts.items()
    _fail_after_first_sub_group(tier, part)
    try:
        train(eng, batches[2])
    except RuntimeError as err:
        out["failed"] = str(err)
    del tier.grad_reader, part.read_master  # the disk is back
    try:
        train(eng, batches[2])
    except Exception as err:  # noqa: BLE001 - what the test asserts
        out["refused"] = f"{type(err).__name__}: {err}"
    # a save now holds the committed master, not the half-updated one the refusal is about
    eng.save_checkpoint(ckpt, tag="after")
    eng.load_checkpoint(ckpt, tag="after")
    train(eng, batches[2])
    got = weights(eng)
    out["equal"] = {n: torch.equal(got[n], want[n]) for n in want}
    out["diff"] = max(float((got[n] - want[n]).abs().max()) for n in want)
    eng.destroy()
    return out


def test_next_step_refused_until_a_load_then_equal_to_a_run_without_the_failure(tmp_path):
    (tmp_path / "nvme").mkdir()
    ranks = run_distributed(_steps, 2, args=(str(tmp_path / "nvme"), str(tmp_path / "ckpt")), timeout=180)
    for rank, out in enumerate(ranks):
        assert "gradient read failed" in out.get("failed", ""), (rank, out)
        _assert_refusal(out.get("refused", ""), rank)
        assert all(out["equal"].values()), (rank, out["equal"], out["diff"])


def _assert_refusal(error: str, where) -> None:
    """The refusal: one line naming the key, the failed restore's error and the fix."""
    assert error.startswith("OffloadIOError: zero_optimization.offload_optimizer.nvme_path: a failed "
                            "optimizer step left"), (where, error)
    assert "master read failed" in error and "load a checkpoint" in error and "\n" not in error, (where, error)


def _refused(call) -> str:
    try:
        call()
    except Exception as err:  # noqa: BLE001 - what the test asserts
        return f"{type(err).__name__}: {err}"
    return "not refused"


def _stack(name: str, nvme_path: str):
    """ZeRO-3 StackNet 5 deep, SGD, with tests/offload_runs.py's offload `name` ("none": without)."""
    from tests.offload_runs import _build, config
    torch.manual_seed(0)
    return _build(config(3, "sgd", {} if name == "none" else name, "fp32", nvme_path), False, False, "stack")


def _train(eng, batch) -> None:
    from tests.models import micro_batches
    from tests.offload_runs import GAS
    for xm, ym in micro_batches(*batch, torch.distributed.get_rank(), torch.distributed.get_world_size(), GAS):
        eng.backward(eng(xm, ym))
        eng.step()


def _weights(eng) -> dict:
    from engine.utils import safe_get_full_fp32_param
    return {n: safe_get_full_fp32_param(p) for n, p in eng.module.named_parameters()}


def _reads(eng, batch) -> dict:
    """Each collective read of the weights, as `_refused` reports it: a forward, a GatheredParameters block,
    safe_get_full_fp32_param."""
    import engine
    from engine.utils import safe_get_full_fp32_param
    from tests.models import micro_batches
    from tests.offload_runs import GAS
    xm, ym = next(micro_batches(*batch, torch.distributed.get_rank(), torch.distributed.get_world_size(), GAS))
    layer = eng.module.layers[1].weight

    def gathered():
        with engine.zero.GatheredParameters([layer]):
            pass
    return {"forward": _refused(lambda: eng(xm, ym)), "gathered": _refused(gathered),
            "full": _refused(lambda: safe_get_full_fp32_param(layer))}


def _stage3_refusals(nvme_path: str, ckpt: str) -> dict:
    """ZeRO-3, SGD, StackNet: the failed step whose restore fails too (as in `_steps`), with the optimizer on
    NVMe and the parameters in host memory (TierMasterStore) or in fp32 NVMe files with a buffer for every
    group (kept buffers, the master copied from them); then every read of the weights, a save and a load."""
    from engine.utils import safe_get_local_fp32_param
    from tests.models import make_batches
    from tests.offload_runs import BOTH_NVME_KEPT, GAS, MICRO, NVME
    batches = make_batches(3, MICRO * GAS * torch.distributed.get_world_size())
    out = {}
    for name in ("none", NVME, BOTH_NVME_KEPT):
        eng = _stack(name, nvme_path)
        for batch in batches[:2]:
            _train(eng, batch)
        if name == "none":
            _train(eng, batches[2])
            out[name] = _weights(eng)
            eng.destroy()
            continue
        state = eng.training_state_dict()  # the committed weights, loaded back below instead of a checkpoint
        tier = eng.zero_optimizer.nvme
        (key, part), = tier.parts.items()
        _fail_after_first_sub_group(tier, part)
        got = {"step": _refused(lambda: _train(eng, batches[2]))}
        del tier.grad_reader, part.read_master  # the disk is back: only a load puts the image right
        got.update(_reads(eng, batches[2]))
        got["local"] = _refused(lambda: safe_get_local_fp32_param(eng.module.layers[1].weight))
        got["next step"] = _refused(lambda: _train(eng, batches[2]))
        eng.save_checkpoint(ckpt, tag=name)  # the committed master (checkpoint/nvme.py)
        if name == NVME:
            eng.load_checkpoint(ckpt, tag=name)
        else:  # a state dict is a load too
            eng.load_training_state_dict(state)
        _train(eng, batches[2])
        out[name] = {"refused": got, "weights": _weights(eng), "copied": part.masters_copied}
        eng.destroy()
    return out


def test_stage3_every_read_of_a_half_updated_image_is_refused_until_a_load(tmp_path):
    (tmp_path / "nvme").mkdir()
    ranks = run_distributed(_stage3_refusals, 2, args=(str(tmp_path / "nvme"), str(tmp_path / "ckpt")), timeout=240)
    for rank, out in enumerate(ranks):
        for name in ("nvme", "both_nvme+kept"):
            refused = out[name]["refused"]
            assert "gradient read failed" in refused.pop("step"), (rank, name, refused)
            for read, error in refused.items():  # each raised the step's refusal
                _assert_refusal(error, (rank, name, read))
            for n, want in out["none"].items():
                got = out[name]["weights"][n]
                assert torch.equal(got, want), (rank, name, n, float((got - want).abs().max()))
        assert out["both_nvme+kept"]["copied"] > 0, "the master was never copied from the kept buffers"


def _one_rank_refuses(nvme_path: str, ckpt: str) -> dict:
    """ZeRO-3, both tiers on NVMe (kept buffers), SGD: rank 1 alone holds a refused image (its `unrestored`
    set by hand: a step another rank failed, whose revert's restore failed here), the other ranks a good
    one. Each read of the weights must end on every rank together (no rank left in a collective), then a
    checkpoint load from before lets training go on."""
    from tests.models import make_batches
    from tests.offload_runs import BOTH_NVME_KEPT, GAS, MICRO
    batches = make_batches(3, MICRO * GAS * torch.distributed.get_world_size())
    out = {}
    for name in ("none", BOTH_NVME_KEPT):
        eng = _stack(name, nvme_path)
        for batch in batches[:2]:
            _train(eng, batch)
        if name != "none":
            eng.save_checkpoint(ckpt, tag="before")
            tier = eng.zero_optimizer.nvme
            if torch.distributed.get_rank() == 1:
                tier.unrestored[next(iter(tier.parts))] = "OSError: master read failed"
            out["refused"] = _reads(eng, batches[2])
            eng.load_checkpoint(ckpt, tag="before")
        _train(eng, batches[2])
        out[name] = _weights(eng)
        eng.destroy()
    return out


def test_stage3_a_refused_image_on_one_rank_ends_each_read_on_every_rank(tmp_path):
    (tmp_path / "nvme").mkdir()
    ranks = run_distributed(_one_rank_refuses, 2, args=(str(tmp_path / "nvme"), str(tmp_path / "ckpt")), timeout=120)
    for read in ("forward", "gathered", "full"):
        _assert_refusal(ranks[1]["refused"][read], (1, read))
        assert ranks[0]["refused"][read] != "not refused" and "rank 1" in ranks[0]["refused"][read], ranks[0]
    for rank, out in enumerate(ranks):
        for n, want in out["none"].items():
            assert torch.equal(out["both_nvme+kept"][n], want), (rank, n)
