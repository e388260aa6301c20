"""engine.compile() / engine.is_compiled (DeepSpeed's names): the module compiled in place with
torch.compile trains exactly as the uncompiled engine at ZeRO stages 0-3 ("eager" and "aot_eager"
backends: no C compiler needed; torch's own compiled graph of the same ops; at stage 3 the hooks are
graph breaks: every parameter partitioned, the hooks run eagerly, so stage 3 compiles the model's graph
only, as stage 0 does), and the compiled forward is the one that runs (torch's compile counter), its first
backward overlapping as uncompiled (no warning that it held the whole gradient); a second call does nothing; a pipeline engine is a one-line error naming why; DeepCompile's arguments are refused."""
from __future__ import annotations

import pytest
import torch

from tests.harness import run_distributed
from tests.models import OddMLP, make_batches, micro_batches

LR, WORLD, STEPS, GAS = 0.1, 2, 3, 2


def _config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": GAS, "gradient_clipping": 0.0,
            "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}}, "zero_allow_untested_optimizer": True,
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}


def _train(stage: int, backend: str | None) -> dict:
    import warnings

    import engine
    from torch._dynamo.utils import counters
    torch.manual_seed(0)
    eng, *_ = engine.initialize(model=OddMLP(), config=_config(stage))
    counters.clear()
    if backend is not None:
        eng.compile(backend=backend)
        eng.compile(backend=backend)  # a second call does nothing
    rank, world = eng.comm.rank, eng.comm.world_size
    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in make_batches(STEPS, 2 * GAS * world):
            for xm, ym in micro_batches(x, y, rank, world, GAS):
                loss = eng(xm, ym)
                eng.backward(loss)
                eng.step()
                losses.append(loss.item())
    held = [str(w.message) for w in caught if "keeps the model's whole gradient" in str(w.message)]
    return {"params": {n: p.detach().clone() for n, p in eng.module.named_parameters()}, "losses": losses,
            "compiled": eng.is_compiled, "frames": counters["stats"]["unique_graphs"], "held": held}


def _runs():
    import torch._dynamo
    out = {}
    for stage in (0, 1, 2, 3):
        for backend in (None, "eager", "aot_eager"):
            torch._dynamo.reset()
            out[(stage, backend)] = _train(stage, backend)
    return out


def test_compiled_engine_trains_as_the_uncompiled_one_at_every_stage():
    for per_rank in run_distributed(_runs, WORLD, timeout=600):
        for (stage, backend), r in per_rank.items():
            plain = per_rank[(stage, None)]
            assert r["compiled"] == (backend is not None)
            assert (r["frames"] > 0) == (backend is not None), (stage, backend)  # the compiled forward ran
            # ZeRO-3's gather/release hooks run eagerly, not traced: the model's graph only, as at stage 0
            assert r["frames"] == per_rank[(0, backend)]["frames"], (stage, backend, r["frames"])
            # a compiled graph's backward delivers each gradient once: the first backward overlaps as
            # uncompiled (zero/arrivals.py's note; it held the whole gradient, and said so, before)
            assert r["held"] == [], (stage, backend)
            assert r["losses"] == pytest.approx(plain["losses"], rel=1e-6, abs=1e-7)
            for n, p in r["params"].items():
                torch.testing.assert_close(p, plain["params"][n], rtol=1e-6, atol=1e-7,
                                           msg=f"stage {stage} backend {backend} parameter {n}")


def _inductor():
    import torch._dynamo
    plain = _train(0, None)
    torch._dynamo.reset()
    return plain, _train(0, "inductor")


def test_inductor_the_default_backend_trains_as_uncompiled():
    """Inductor generates C++ (gcc here) and fuses ops, so its sums round differently: close, not equal."""
    plain, compiled = run_distributed(_inductor, 1, timeout=600)[0]
    assert compiled["compiled"] and compiled["frames"] > 0
    assert compiled["losses"] == pytest.approx(plain["losses"], rel=1e-5, abs=1e-6)
    for n, p in compiled["params"].items():
        torch.testing.assert_close(p, plain["params"][n], rtol=1e-5, atol=1e-6, msg=f"parameter {n}")


def _refusals() -> dict:
    import engine
    from engine.pipe import PipelineModule
    from tests.pipe_models import mlp_specs, mse
    out = {}
    eng, *_ = engine.initialize(model=OddMLP(), config=_config(0))
    with pytest.raises(ValueError) as err:
        eng.compile(backend="eager", schedule=[(0, "pass")])
    out["schedule"] = str(err.value)
    pm = PipelineModule(mlp_specs(4), num_stages=2, loss_fn=mse, seed_layers=True, partition_method="uniform")
    eng, *_ = engine.initialize(model=pm, config=_config(0))
    with pytest.raises(RuntimeError) as err:
        eng.compile(backend="eager")
    out["pipe"] = (str(err.value), eng.is_compiled)
    return out


def test_pipeline_and_deepcompile_arguments_are_refused():
    r = run_distributed(_refusals, WORLD, timeout=120)[0]
    assert "DeepCompile" in r["schedule"]
    assert "not built for a PipelineModule" in r["pipe"][0] and r["pipe"][1] is False


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
