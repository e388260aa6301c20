"""A checkpoint that would not resume as the run that saved it goes on says so, at save or at load.

- Saved in the middle of a gradient-accumulation window (after micro-step 1 of 2): the checkpoint holds
  no gradient, so a resume starts a new window after the micro-batch already drawn and ends a step
  short of the run that went on (measured: 3 global steps against 4 after the same 5 micro-steps,
  weights 0.035 apart). Both the save and the load warn, naming the window; a save at a boundary
  and its load stay quiet.
- Saved by one optimizer and loaded into an engine whose optimizer keeps other state (Lion's exp_avg
  into AdamW): a CheckpointError at load naming metadata.json and the fix (`load_optimizer_states=False`),
  not a KeyError at the next step (Lion -> AdamW) or Adam's moments and betas taken silently as
  Lion's (AdamW -> Lion). An optimizer with the same state (AdamW -> Adam) loads, and
  `load_optimizer_states=False` takes the weights of a mismatched one.
- Saved in one precision and loaded in another: the loss scaler is the new precision's, from its config.
  It was the saved one: a bf16 checkpoint gave an fp16 engine bf16's static scale of 1 (no dynamic
  scaling: fp16 gradients underflow), an fp16 one gave a bf16 engine fp16's dynamic scale of 256.
- `latest` naming a tag that is gone: a CheckpointError naming `latest` (it was a warning and a fresh
  start, also for checkpoint.auto_resume).
- A client_state that a weights_only load would refuse fails the save on every rank, before any file is
  written (it raised on rank 0 only, and a job that caught it hung at its next collective).
- Ranks saving under different tags (tag_validation Warn, the default) save one whole checkpoint under
  rank 0's tag (each wrote into its own tag's directory: `latest` named a checkpoint missing rank 1's file).
- A rank file that cannot be written (a full disk) on one rank, or rank 0's commit failing, fails the
  save on every rank (it raised on that rank only, and a job that caught it hung likewise).
2 ranks, ZeRO stages 0 and 2, fp32 (and bf16/fp16 for the scaler).
"""
from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import pytest
import torch

import engine
from engine.checkpoint.format import CheckpointError
from tests.harness import run_distributed
from tests.models import OddMLP
from tests.worlds import new_world

STAGES = (0, 2)


def _dataset():
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(torch.randn(80, 13, generator=g), torch.randn(80, 5, generator=g))


PRECISIONS = {"fp16": {"fp16": {"enabled": True, "initial_scale_power": 8}}, "bf16": {"bf16": {"enabled": True}}}


def _engine(stage: int, optimizer: str = "AdamW", gas: int = 1, precision: str | None = None):
    torch.manual_seed(0)
    cfg = {**PRECISIONS.get(precision, {}), "train_batch_size": 8, "gradient_accumulation_steps": gas, "gradient_clipping": 0.0,
           "optimizer": {"type": optimizer, "params": {"lr": 1e-3}}, "zero_optimization": {"stage": stage}}
    eng, _, loader, _ = engine.initialize(model=OddMLP(), config=cfg, training_data=_dataset())
    return eng, iter(loader)


def _micro_steps(eng, batches, n: int) -> None:
    dtype = eng.module.l1.weight.dtype
    for _ in range(n):
        x, y = next(batches)
        eng.backward(eng(x.to(dtype), y.to(dtype)))
        eng.step()


def _warnings_of(call) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return [str(w.message) for w in caught if "accumulation window" in str(w.message)]


def _window_case(root: str, stage: int) -> dict:
    eng, batches = _engine(stage, gas=2)
    _micro_steps(eng, batches, 2)
    at_boundary = _warnings_of(lambda: eng.save_checkpoint(root, tag="boundary"))
    _micro_steps(eng, batches, 1)
    mid_window = _warnings_of(lambda: eng.save_checkpoint(root, tag="mid"))
    fresh, _ = _engine(stage, gas=2)
    load_boundary = _warnings_of(lambda: fresh.load_checkpoint(root, tag="boundary"))
    load_mid = _warnings_of(lambda: fresh.load_checkpoint(root, tag="mid"))
    return {"save_boundary": at_boundary, "save_mid": mid_window, "load_boundary": load_boundary,
            "load_mid": load_mid}


def _attempt(call):
    try:
        call()
        return None
    except CheckpointError as e:
        return str(e)


def _optimizer_case(root: str, stage: int) -> dict:
    out = {}
    for saved, loaded in (("Lion", "AdamW"), ("AdamW", "Lion"), ("AdamW", "Adam")):
        eng, batches = _engine(stage, saved)
        _micro_steps(eng, batches, 2)
        eng.save_checkpoint(f"{root}/{saved}")
        target, batches = _engine(stage, loaded)
        error = _attempt(lambda: target.load_checkpoint(f"{root}/{saved}"))
        if error is not None:  # the weights alone still load, and training goes on
            target.load_checkpoint(f"{root}/{saved}", load_optimizer_states=False)
            _micro_steps(target, batches, 1)
        out[(saved, loaded)] = error
    return out


def _scaler_case(root: str, stage: int) -> dict:
    """The scaler after loading each precision's checkpoint into the other, and a fresh engine's."""
    out = {}
    for saved, loaded in (("bf16", "fp16"), ("fp16", "bf16")):
        eng, batches = _engine(stage, precision=saved)
        _micro_steps(eng, batches, 2)
        eng.save_checkpoint(f"{root}/{saved}")
        target, _ = _engine(stage, precision=loaded)
        fresh = target.zero_optimizer.guard.scaler.state_dict()
        target.load_checkpoint(f"{root}/{saved}")
        out[(saved, loaded)] = (target.zero_optimizer.guard.scaler.state_dict(), fresh)
    return out


def _run(root: str) -> dict:
    import torch.distributed as dist
    rank, out = dist.get_rank(), {}
    for stage in STAGES:
        new_world(f"{root}/world_window{stage}", rank, 2)
        out[("window", stage)] = _window_case(f"{root}/window{stage}", stage)
        new_world(f"{root}/world_optimizer{stage}", rank, 2)
        out[("optimizer", stage)] = _optimizer_case(f"{root}/optimizer{stage}", stage)
        new_world(f"{root}/world_scaler{stage}", rank, 2)
        out[("scaler", stage)] = _scaler_case(f"{root}/scaler{stage}", stage)
    return out


@pytest.fixture(scope="module")
def runs():
    with tempfile.TemporaryDirectory() as root:
        return run_distributed(_run, 2, args=(root,), timeout=300)


@pytest.mark.parametrize("stage", STAGES)
def test_a_save_inside_an_accumulation_window_warns_at_save_and_load(runs, stage):
    rank0, rank1 = (r[("window", stage)] for r in runs)
    assert rank0["save_boundary"] == [] and rank0["load_boundary"] == []
    assert len(rank0["save_mid"]) == 1 and "micro-step 1 of 2" in rank0["save_mid"][0]
    assert len(rank0["load_mid"]) == 1 and "micro-step 1 of 2" in rank0["load_mid"][0]
    assert rank1["save_mid"] == [] and rank1["load_mid"] == []  # one warning per job, from rank 0


@pytest.mark.parametrize("stage", STAGES)
def test_optimizer_state_of_another_kind_is_refused_at_load(runs, stage):
    for per_rank in runs:
        errors = per_rank[("optimizer", stage)]
        assert errors[("AdamW", "Adam")] is None  # the same state: loads
        for saved, loaded in (("Lion", "AdamW"), ("AdamW", "Lion")):
            error = errors[(saved, loaded)]
            assert error is not None and "metadata.json" in error and "load_optimizer_states=False" in error
            assert saved in error and loaded in error and "\n" not in error


@pytest.mark.parametrize("stage", STAGES)
def test_a_load_in_another_precision_keeps_the_new_precisions_loss_scaler(runs, stage):
    for per_rank in runs:
        cases = per_rank[("scaler", stage)]
        for (saved, loaded), (got, fresh) in cases.items():
            assert got == fresh, f"{saved} checkpoint into {loaded}: scaler {got}, the {loaded} config's {fresh}"
        assert cases[("bf16", "fp16")][0]["dynamic"] and cases[("bf16", "fp16")][0]["cur_scale"] == 256.0


def test_latest_naming_a_missing_tag_is_an_error_not_a_fresh_start(tmp_path):
    """`latest` names a tag whose directory is gone (deleted by hand, or a crash while a tag was saved
    again): a CheckpointError naming `latest` and the tags there. It was a warning and (None, None), so a
    job with checkpoint.auto_resume started again from step 0."""
    from engine.checkpoint.format import write_latest
    from engine.checkpoint.reader import resolve
    (tmp_path / "global_step2").mkdir()
    (tmp_path / "global_step2" / "manifest.json").write_text("{}")
    write_latest(tmp_path, "global_step4")
    with pytest.raises(CheckpointError) as e:
        resolve(tmp_path, None)
    message = str(e.value)
    assert str(tmp_path / "latest") in message and "global_step4" in message and "global_step2" in message
    assert "\n" not in message
    with pytest.warns(UserWarning, match="does not exist"):  # a tag asked for by name: DeepSpeed's (None, None)
        assert resolve(tmp_path, "global_step9") is None


class _Opaque:
    """A client_state value torch.load(weights_only=True) refuses."""


def _refused_client_state(root: str) -> dict:
    """Every rank's answer to a save whose client_state rank 0 refuses, and that the job goes on: a
    training step (a collective) after the caught error, then a good save."""
    eng, batches = _engine(0)
    _micro_steps(eng, batches, 1)
    eng.save_checkpoint(root, tag="good")
    try:
        eng.save_checkpoint(root, tag="bad", client_state={"obj": _Opaque()})
        error = None
    except TypeError as e:
        error = str(e)
    _micro_steps(eng, batches, 1)
    eng.save_checkpoint(root, tag="after")
    return {"error": error, "latest": (Path(root) / "latest").read_text()}


def test_a_refused_client_state_fails_the_save_on_every_rank(tmp_path):
    """It raised on rank 0 only: the other ranks went on writing and waited in the commit's exchange for
    rank 0, which had left the save, so a job that caught the error hung at its next collective."""
    for result in run_distributed(_refused_client_state, 2, args=(str(tmp_path),), timeout=120):
        assert result["error"] is not None and "client_state" in result["error"] and "_Opaque" in result["error"]
        assert "\n" not in result["error"] and "\x1b" not in result["error"]
        assert result["latest"] == "after"
    assert not (tmp_path / "bad").exists()


def test_a_loaded_data_position_is_saved_again_before_any_batch():
    """A checkpoint loaded and saved again before the next pass (a job converting a checkpoint to another
    world size, a save right after a resume) keeps the data position. The loader's state said batch 0 of
    the epoch until a pass consumed the pending skip, so that save replayed the epoch from its start."""
    from engine.data import DistributedDataLoader
    dataset = torch.utils.data.TensorDataset(torch.arange(16))
    whole = [b[0].tolist() for b in DistributedDataLoader(dataset, 2, 0, 1, seed=1)]
    resumed = DistributedDataLoader(dataset, 2, 0, 1, seed=1)
    resumed.load_state_dict({"epoch": 0, "batches_in_epoch": 3})
    again = DistributedDataLoader(dataset, 2, 0, 1, seed=1)
    again.load_state_dict(resumed.state_dict())
    assert resumed.state_dict() == {"epoch": 0, "batches_in_epoch": 3}
    assert [b[0].tolist() for b in again] == whole[3:]


def _failed_write(root: str, where: str) -> dict:
    """Rank 1's rank file cannot be written (a full disk, say), or rank 0's commit fails, in a save that
    each rank catches; then a training step (a collective) and a good save."""
    import errno

    import torch.distributed as dist

    from engine.checkpoint import writer
    eng, batches = _engine(0)
    _micro_steps(eng, batches, 1)
    eng.save_checkpoint(root, tag="good")
    name, rank = {"write": ("_save_file", 1), "commit": ("_commit", 0)}[where]
    real = getattr(writer, name)

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    if dist.get_rank() == rank:
        setattr(writer, name, full_disk)
    try:
        eng.save_checkpoint(root, tag="bad")
        error = None
    except (OSError, RuntimeError) as e:
        error = str(e)
    setattr(writer, name, real)
    _micro_steps(eng, batches, 1)
    eng.save_checkpoint(root, tag="after")
    return {"error": error, "latest": (Path(root) / "latest").read_text()}


@pytest.mark.parametrize("where, rank", [("write", 1), ("commit", 0)])
def test_a_write_that_fails_on_one_rank_fails_the_save_on_every_rank(tmp_path, where, rank):
    """It raised on that rank only: the others waited in the commit's exchange (or its final barrier) for
    it, so a job that caught the error hung at its next collective. No `bad` tag appears."""
    for result in run_distributed(_failed_write, 2, args=(str(tmp_path), where), timeout=120):
        assert result["error"] is not None and f"rank {rank}: " in result["error"]
        assert "No space left" in result["error"] and "\n" not in result["error"]
        assert result["latest"] == "after"
    assert not (tmp_path / "bad").exists()


def _disagreeing_tags(root: str) -> dict:
    import torch.distributed as dist
    eng, batches = _engine(0)
    _micro_steps(eng, batches, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eng.save_checkpoint(root, tag=f"t{dist.get_rank()}")  # checkpoint.tag_validation: Warn (the default)
    eng.load_checkpoint(root)
    return {"warnings": [str(w.message) for w in caught if "tag" in str(w.message)],
            "latest": (Path(root) / "latest").read_text()}


def test_ranks_saving_under_different_tags_save_one_whole_checkpoint(tmp_path):
    """With tag_validation Warn each rank wrote into its own tag's directory and rank 0 committed its tag
    without rank 1's file: `latest` named a checkpoint that failed verification ("rank_00001.pt: missing").
    Now every rank saves under rank 0's tag, and the warning says so."""
    for result in run_distributed(_disagreeing_tags, 2, args=(str(tmp_path),), timeout=120):
        assert result["latest"] == "t0"
        assert len(result["warnings"]) == 1 and "rank 0's tag 't0'" in result["warnings"][0]
    assert not (tmp_path / "t1").exists()
