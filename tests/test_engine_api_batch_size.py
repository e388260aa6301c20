"""Changing the batch size mid-training (engine.set_train_batch_size / set_train_micro_batch_size,
DeepSpeed's batch-size warm-up): a run whose global batch changes between steps equals single-process
SGD on the same global batches (no clipping, so a stale 1/gas or a window of the wrong length shows in
the weights), at ZeRO stages 0-3 and for the pipeline engine; what follows the change (counters, the
engine-built loader, a checkpoint's record); the errors for a bad value and for a call mid-window."""
from __future__ import annotations

import pytest
import torch

from tests.harness import run_distributed
from tests.models import OddMLP, make_batches, micro_batches, reference_train

LR, WORLD = 0.1, 2
# (call, value) before each step; None keeps the batch. Starts at micro 2, gas 2: 8 samples per step.
PLAN = [None, ("set_train_batch_size", 12), None, ("set_train_batch_size", 4),
        ("set_train_micro_batch_size", 3), ("set_train_batch_size", 18)]
SIZES = [8, 12, 12, 4, 6, 18]  # the global batch each step trains on (gas: 2, 3, 3, 1, 1, 3)


def _config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 0.0,
            "optimizer": {"type": "SGD", "params": {"lr": LR}}, "zero_allow_untested_optimizer": True,
            "zero_optimization": {"stage": stage}}


def _global_batches():
    return [make_batches(1, n, seed=s)[0] for s, n in enumerate(SIZES)]


def _train(stage: int) -> dict:
    import engine
    torch.manual_seed(0)
    eng, *_ = engine.initialize(model=OddMLP(), config=_config(stage))
    rank, world = eng.comm.rank, eng.comm.world_size
    seen = []
    for change, (x, y) in zip(PLAN, _global_batches()):
        if change is not None:
            getattr(eng, change[0])(change[1])
        gas = eng.gradient_accumulation_steps()
        seen.append((eng.train_batch_size(), eng.train_micro_batch_size_per_gpu(), gas))
        for k, (xm, ym) in enumerate(micro_batches(x, y, rank, world, gas)):
            assert eng.is_gradient_accumulation_boundary() == (k == gas - 1)
            eng.backward(eng(xm, ym))
            eng.step()
    with engine.zero.GatheredParameters(list(eng.module.parameters())):  # stage 3; a no-op elsewhere
        params = {n: p.detach().clone() for n, p in eng.module.named_parameters()}
    return {"params": params, "seen": seen, "counters": (eng.global_steps, eng.global_samples, eng.micro_steps)}


def _stages():
    return [_train(stage) for stage in (0, 1, 2, 3)]


def test_batch_size_changes_mid_training_match_sgd_at_every_stage():
    results = run_distributed(_stages, WORLD, timeout=300)
    ref, _, _ = reference_train(_reference_model(), _global_batches(),
                                lambda ps: torch.optim.SGD(ps, lr=LR))
    want = dict(ref.named_parameters())
    for rank_results in results:
        for stage, r in enumerate(rank_results):
            assert r["seen"] == [(8, 2, 2), (12, 2, 3), (12, 2, 3), (4, 2, 1), (6, 3, 1), (18, 3, 3)]
            assert r["counters"] == (len(SIZES), sum(SIZES), 2 + 3 + 3 + 1 + 1 + 3)
            for n, p in r["params"].items():
                torch.testing.assert_close(p, want[n].detach(), rtol=1e-5, atol=1e-6,
                                           msg=f"stage {stage} parameter {n}")
    assert not torch.allclose(want["l1.weight"], _reference_model().l1.weight)  # training moved it


def _reference_model():
    torch.manual_seed(0)
    return OddMLP()


def _errors() -> dict:
    import engine
    eng, *_ = engine.initialize(model=OddMLP(), config=_config(0))
    out = {}
    for call, value in (("set_train_batch_size", 10), ("set_train_batch_size", 0),
                        ("set_train_micro_batch_size", 1.5)):
        with pytest.raises(ValueError) as err:
            getattr(eng, call)(value)
        out[(call, value)] = str(err.value)
    (x, y), = make_batches(1, 2)
    eng.backward(eng(x, y))
    eng.step()  # one micro-step of a window of 2
    for call in ("set_train_batch_size", "set_train_micro_batch_size"):
        with pytest.raises(RuntimeError) as err:
            getattr(eng, call)(8)
        out[call] = str(err.value)
    out["unchanged"] = (eng.train_batch_size(), eng.gradient_accumulation_steps())
    return out


def test_bad_values_and_calls_mid_window_are_errors():
    r = run_distributed(_errors, WORLD, timeout=120)[0]
    assert "train_micro_batch_size_per_gpu 2 × data-parallel world size 2 = 4" in r[("set_train_batch_size", 10)]
    assert "expected a positive integer" in r[("set_train_batch_size", 0)]
    assert "expected a positive integer" in r[("set_train_micro_batch_size", 1.5)]
    for call in ("set_train_batch_size", "set_train_micro_batch_size"):
        assert "inside a gradient-accumulation window (1 of 2 micro-steps taken)" in r[call]
    assert r["unchanged"] == (8, 2)


def _loader_follows() -> dict:
    import engine
    from engine.checkpoint.snapshot import _engine_state
    dataset = torch.utils.data.TensorDataset(torch.randn(24, 13), torch.randn(24, 5))
    eng, _, loader, _ = engine.initialize(model=OddMLP(), config=_config(0), training_data=dataset)
    out = {"first": [len(b[0]) for b in loader]}
    it = iter(loader)
    next(it)
    with pytest.raises(RuntimeError) as err:
        eng.set_train_micro_batch_size(3)
    out["mid_pass"] = str(err.value)
    del it  # the pass is left
    eng.set_train_micro_batch_size(3)
    out["second"] = [len(b[0]) for b in loader]
    out["recorded"] = _engine_state(eng, None)["data_sampler"]["micro_batch"]
    return out


def test_engine_built_loader_yields_the_new_micro_batch_from_its_next_pass():
    r = run_distributed(_loader_follows, 1, timeout=120)[0]
    assert r["first"] == [2] * 12
    assert "in the middle of a pass (1 of 12 batches of 2 handed out)" in r["mid_pass"]
    assert r["second"] == [3] * 8
    assert r["recorded"] == 3



def _resumed_position(save_dir: str) -> dict:
    """A warm-up run saved at micro-batch 4 after 2 batches; the resumed run starts at the config's micro 2,
    loads, and sets micro 4 again before its first pass: its first batch is the saving run's third."""
    import engine
    dataset = torch.utils.data.TensorDataset(torch.arange(48, dtype=torch.float32))
    cfg = {**_config(0), "gradient_accumulation_steps": 1}
    eng, _, loader, _ = engine.initialize(model=OddMLP(), config={**cfg, "train_micro_batch_size_per_gpu": 4},
                                          training_data=dataset)
    it = iter(loader)
    next(it), next(it)
    eng.save_checkpoint(save_dir, tag="warm")
    want = next(it)[0].tolist()
    del it
    eng, _, loader, _ = engine.initialize(model=OddMLP(), config=cfg, training_data=dataset)
    eng.load_checkpoint(save_dir, tag="warm")
    eng.set_train_micro_batch_size(4)
    return {"want": want, "got": next(iter(loader))[0].tolist()}


def test_a_loaded_position_is_kept_in_samples_when_the_micro_batch_changes(tmp_path):
    r = run_distributed(_resumed_position, 1, args=(str(tmp_path),), timeout=120)[0]
    assert r["got"] == r["want"]  # it skipped 4 batches of the new 4 (the position in batches of 2)


def test_a_loaded_position_that_is_the_epochs_end_at_the_new_micro_batch_goes_on_with_the_next_epoch():
    from engine.data import DistributedDataLoader
    dataset = torch.utils.data.TensorDataset(torch.arange(10, dtype=torch.float32))
    loader = DistributedDataLoader(dataset, 3, 0, 1, seed=0, drop_last=True)
    loader.load_state_dict({"epoch": 0, "batches_in_epoch": 2})  # 6 of the epoch's 9 samples
    loader.set_micro_batch_size(6, "engine.set_train_micro_batch_size")  # one batch of 6: all of them
    fresh = DistributedDataLoader(dataset, 6, 0, 1, seed=0, drop_last=True)
    next(iter(fresh))
    want = next(iter(fresh))[0].tolist()  # epoch 1's batch
    assert [b[0].tolist() for b in loader] == [want]  # not an empty pass (a pipeline's loader ended)

# -- the pipeline engine: train_batch pulls the new number of micro-batches -----------------------------
PIPE_GAS = [2, 4, 1, 3]  # 1 < stages: the 1F1B schedule falls back to GPipe's order


def _pipe_train() -> dict:
    import engine
    from engine.pipe import PipelineModule
    from tests.pipe_models import global_batches, mlp_specs, mse
    pm = PipelineModule(mlp_specs(8), num_stages=2, loss_fn=mse, seed_layers=True, partition_method="uniform")
    cfg = {**_config(0), "pipeline": {"schedule": "1f1b"}}
    eng, *_ = engine.initialize(model=pm, config=cfg)
    losses = []
    for i, gas in enumerate(PIPE_GAS):
        eng.set_train_batch_size(2 * gas)
        (x, y), = global_batches(1, 2 * gas, tied=False, seed=i)
        losses.append(float(eng.train_batch(iter(list(micro_batches(x, y, 0, 1, gas))))))
    return {"params": {n: p.detach().clone() for n, p in pm.named_parameters()}, "losses": losses,
            "samples": eng.global_samples}


def test_pipeline_train_batch_follows_the_new_batch_size():
    from tests.pipe_models import global_batches, mlp_specs, mse, reference_params, reference_sgd
    results = run_distributed(_pipe_train, 2, timeout=300)
    batches = [global_batches(1, 2 * gas, tied=False, seed=i)[0] for i, gas in enumerate(PIPE_GAS)]
    ref, ref_losses = reference_sgd(mlp_specs(8), batches, mse, LR, len(batches))
    want, seen = reference_params(ref), set()
    for r in results:
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
        assert r["samples"] == 2 * sum(PIPE_GAS)
        for n, p in r["params"].items():
            torch.testing.assert_close(p, want[n], rtol=1e-5, atol=1e-6, msg=f"parameter {n}")
            seen.add(n)
    assert seen == set(want)


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
