"""Pipeline checkpoints (engine/checkpoint/placement.py): a run of 2 pipeline stages × 2 data-parallel
ranks saves through `checkpoint.save_interval` at step 4 and trains 3 more steps; the checkpoint, loaded
at 4 data-parallel ranks (a one-stage PipelineModule, the same parameter names) and at 1 process
(through `checkpoint.auto_resume`), continues with the same 3 steps to the same weights and losses.
SGD with momentum and ZeRO-1, no clipping: the update is linear in the gradient (a wrong scale shows)
and the momentum buffer, partitioned over the data axis, must come back row for row. The global batch
is the same at every layout (micro-batch × data ranks constant), so only the reductions' summation
order differs: fp32 tolerance rtol 1e-5. `dstrain ckpt info` reads the checkpoint."""
from __future__ import annotations

import json

import pytest
import torch

from tests.harness import run_distributed
from tests.models import micro_batches
from tests.pipe_models import global_batches, lm_loss, tied_specs

LR, MOMENTUM, GAS, GLOBAL, SAVE_AT, STEPS = 0.1, 0.9, 2, 8, 4, 7  # no periodic save after SAVE_AT
TAG = f"global_step{SAVE_AT}"


def _config(save_dir: str, dp: int, extra: dict | None = None) -> dict:
    return {"train_micro_batch_size_per_gpu": GLOBAL // (GAS * dp), "gradient_accumulation_steps": GAS,
            "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": MOMENTUM}},
            "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": 1},
            "checkpoint": {"save_dir": save_dir, **(extra or {})}}


def _engine(stages: int, save_dir: str, dp: int, extra: dict | None = None):
    import engine
    from engine.pipe import PipelineModule
    pm = PipelineModule(tied_specs(4), num_stages=stages, loss_fn=lm_loss, seed_layers=True,
                        partition_method="uniform")
    eng, *_ = engine.initialize(model=pm, config=_config(save_dir, dp, extra))
    return eng, pm


def _train(eng, steps: range) -> list[float]:
    dp, dp_rank = eng.comm.world_size, eng.comm.rank
    batches = global_batches(STEPS, GLOBAL, True)
    return [float(eng.train_batch(iter(list(micro_batches(*batches[s], dp_rank, dp, GAS))))) for s in steps]


def _params(pm) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in pm.named_parameters()}


def _save_then_load_at_four_data(save_dir: str):
    """2 pipe × 2 data: save at step SAVE_AT (save_interval), continue; then the same 4 ranks as
    1 pipe × 4 data load the tag and train the same steps."""
    eng, pm = _engine(2, save_dir, dp=2, extra={"save_interval": SAVE_AT})
    _train(eng, range(SAVE_AT))
    eng.wait_for_checkpoint()
    at_save = _params(pm)
    losses = _train(eng, range(SAVE_AT, STEPS))
    uninterrupted = (_params(pm), losses, eng.stage_id)
    eng.destroy()
    eng4, pm4 = _engine(1, save_dir, dp=4)
    path, _ = eng4.load_checkpoint(save_dir)
    steps_loaded = eng4.global_steps
    losses4 = _train(eng4, range(SAVE_AT, STEPS))
    return uninterrupted, at_save, (_params(pm4), losses4), steps_loaded, path


def _resume_in_one_process(save_dir: str):
    eng, pm = _engine(1, save_dir, dp=1, extra={"auto_resume": True})
    steps_loaded = eng.global_steps
    losses = _train(eng, range(SAVE_AT, STEPS))
    return _params(pm), losses, steps_loaded


def _whole(per_rank) -> tuple[dict, list[float]]:
    """The model the stages hold together (tied weights equal on both stages) and the losses."""
    params: dict = {}
    for rank_params, losses, _ in per_rank:
        for name, p in rank_params.items():
            if name in params:
                torch.testing.assert_close(p, params[name])  # data ranks and tied copies agree
            params[name] = p
    return params, per_rank[0][1]


def _assert_same(params: dict, want: dict, what: str) -> None:
    assert set(params) == set(want), what
    for name, p in want.items():
        torch.testing.assert_close(params[name], p, rtol=1e-5, atol=1e-6, msg=f"{what}: parameter {name}")


def test_save_at_two_stages_by_two_data_load_at_four_data_and_one_process(tmp_path, capsys):
    save_dir = str(tmp_path / "ckpt")
    per_rank = run_distributed(_save_then_load_at_four_data, world_size=4, args=(save_dir,), timeout=240)
    want, want_losses = _whole([r[0] for r in per_rank])
    at_save, _ = _whole([(r[1], None, None) for r in per_rank])
    assert any(not torch.allclose(at_save[n], want[n]) for n in want)  # the 3 steps moved the model
    assert {r[0][2] for r in per_rank} == {0, 1}
    for params, losses in (r[2] for r in per_rank):
        _assert_same(params, want, "4 data ranks after loading")
        assert losses == pytest.approx(want_losses, rel=1e-5)
    assert {r[3] for r in per_rank} == {SAVE_AT}

    meta = json.loads((tmp_path / "ckpt" / TAG / "metadata.json").read_text())
    assert meta["world_size"] == 4 and meta["pipe_parallel_size"] == 2 and meta["data_parallel_size"] == 2
    assert sorted(map(tuple, meta["coordinates"])) == [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)]
    files = json.loads((tmp_path / "ckpt" / TAG / "manifest.json").read_text())["files"]
    assert sum(name.startswith("rank_") for name in files) == 4  # one file per process, no collision
    for name, entry in meta["params"].items():  # each parameter once, full shape, from one stage
        assert entry["shape"] == list(want[name].shape)
        stages = {meta["coordinates"][rank][0] for rank, _, _ in entry["fragments"]}
        assert len(stages) == 1, name

    [(params, losses, steps_loaded)] = run_distributed(_resume_in_one_process, world_size=1, args=(save_dir,),
                                                       timeout=120)
    assert steps_loaded == SAVE_AT
    _assert_same(params, want, "1 process after auto_resume")
    assert losses == pytest.approx(want_losses, rel=1e-5)

    from engine.cli import main
    capsys.readouterr()
    assert main(["ckpt", "info", save_dir]) == 0
    report = capsys.readouterr().out
    assert f"{TAG} (latest): step {SAVE_AT}, world size 4 (pipe 2 × data 2 × model 1)" in report
    assert "checksums ok" in report
