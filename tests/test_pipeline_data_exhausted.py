"""A pipeline's data iterator that runs out (engine/pipe/batch_agreement.py): every rank of the world —
the stages that read no data, the other data-parallel replicas — raises `DataExhausted` at once, whichever
reader ran out (first stage, last stage, one replica) and wherever (the step's first micro-batch or a later
one, train_batch or eval_batch); nothing changed: training on with fresh iterators ends bit for bit where a
run that never met the exhausted calls ends, with the same step counters, over a process group that works.
The same for a mixed batch on one replica (ValueError everywhere), an iterator that raises (its own
error on that rank, DataReadFailed on the others) and a first stage's batch without a key (a namedtuple:
torch cannot serialise its tree spec; torch's error there, DataReadFailed elsewhere).

Each spawn trains two engines on the same batches: A meets the exhausted calls between its steps, B does
not. A hang is the harness's timeout."""
from __future__ import annotations

import collections
import time

import pytest

from tests.harness import run_distributed
from tests.models import micro_batches
from tests.pipe_models import assert_trained_alike, global_batches, mlp_specs, mse, trained_state

LR, MICRO, GAS, STEPS = 0.1, 2, 2, 3
Inputs = collections.namedtuple("Inputs", "x")  # a batch with no key: its tree spec has no serialised form


def _config(zero: int) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
            "optimizer": {"type": "SGD", "params": {"lr": LR}}, "zero_allow_untested_optimizer": True,
            "gradient_clipping": 0.0, "zero_optimization": {"stage": zero},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}}}  # the step count shows in the LR


def _engine(stages: int, zero: int):
    import engine
    from engine.pipe import PipelineModule
    pm = PipelineModule(mlp_specs(8), num_stages=stages, loss_fn=mse, seed_layers=True, partition_method="uniform")
    eng, *_ = engine.initialize(model=pm, config=_config(zero))
    return pm, eng


def _iterator(eng, batch, micro: int):
    """This rank's first `micro` micro-batches of `batch` (GAS of them: an iterator that lasts the step)."""
    dp, rank = eng.comm.world_size, eng.comm.rank
    return iter(list(micro_batches(*batch, rank, dp, GAS))[:micro])


def _exhausted_call(eng, batch, case) -> tuple[str, float, bool, bool]:
    """One call whose iterator runs out on the readers `case` names: (kind, micro-batches the short readers
    get, {"first","last"}, data-parallel ranks or None for all); the other readers get the whole step. Kind
    "mixed": the named readers' step is whole, but its last micro-batch one row short (refused everywhere);
    "raises": their iterator raises where it would run out."""
    from engine.pipe import DataExhausted, DataReadFailed
    kind, micro, readers, replicas = case
    role = ("first" if eng.is_first_stage else "") + ("last" if eng.is_last_stage else "")
    short = any(r in role for r in readers) and (replicas is None or eng.comm.rank in replicas)
    data = list(_iterator(eng, batch, micro if short and kind in ("train", "eval") else GAS))
    if short and kind == "mixed":
        data[-1] = tuple(t[:-1] for t in data[-1])
    if short and kind == "no_key":
        data = [(Inputs(x), y) for x, y in data]
    data = _raising(data, micro) if short and kind == "raises" else iter(data)
    start = time.monotonic()
    try:
        eng.eval_batch(data) if kind == "eval" else eng.train_batch(data)
        message = "no error"
    except (DataExhausted, DataReadFailed, ValueError, BrokenSample, NotImplementedError) as err:
        message = str(err)
    return message, time.monotonic() - start, _held(eng), short


class BrokenSample(Exception):
    pass


def _raising(data: list, at: int):
    """An iterator that raises at its micro-batch `at` (a DataLoader worker's error, say)."""
    yield from data[:at]
    raise BrokenSample("a broken sample")


def _held(eng) -> bool:
    """ZeRO-3's stage parameters gathered for a schedule run (engine/pipe/zero3.py), left so by the call."""
    coordinator = getattr(eng.zero_optimizer, "coordinator", None)
    return coordinator is not None and coordinator.held


def _run(stages: int, zero: int, cases: list) -> dict:
    """Engine A meets `cases` (one before each step, cycling), then trains STEPS batches; B only trains."""
    pm_a, eng_a = _engine(stages, zero)
    batches = global_batches(STEPS + 1, MICRO * GAS * eng_a.comm.world_size, False)
    errors, losses = [], []
    for i, case in enumerate(cases):
        errors.append(_exhausted_call(eng_a, batches[-1], case))
        if i % 2:  # train between some exhausted calls, and meet others back to back
            losses.append(float(eng_a.train_batch(_iterator(eng_a, batches[i // 2 % STEPS], GAS))))
    a_losses = [float(eng_a.train_batch(_iterator(eng_a, b, GAS))) for b in batches[:STEPS]]
    pm_b, eng_b = _engine(stages, zero)
    b_losses = [float(eng_b.train_batch(_iterator(eng_b, b, GAS))) for b in [batches[i // 2 % STEPS] for i in
                                                                              range(len(cases)) if i % 2]]
    b_losses += [float(eng_b.train_batch(_iterator(eng_b, b, GAS))) for b in batches[:STEPS]]
    return {"errors": errors, "a": trained_state(pm_a, eng_a), "b": trained_state(pm_b, eng_b), "stage": eng_a.stage_id,
            "losses": (losses + a_losses, b_losses)}


# (kind, micro-batches the short readers get, which readers, which data-parallel ranks: None = all)
ALL_SHORT = [("train", 0, {"first", "last"}, None), ("train", 1, {"first", "last"}, None),
             ("train", 1, {"last"}, None), ("train", 0, {"first"}, None), ("eval", 1, {"first", "last"}, None),
             ("eval", 0, {"last"}, None), ("raises", 1, {"last"}, None), ("no_key", GAS, {"first"}, None)]
ONE_REPLICA_SHORT = [("train", 1, {"first", "last"}, {1}), ("train", 0, {"last"}, {0}),
                     ("train", 1, {"first"}, {1}), ("eval", 0, {"first", "last"}, {0}),
                     ("mixed", GAS, {"first"}, {1}), ("raises", 0, {"first"}, {0})]


def _each(layouts: list) -> list:
    return [_run(stages, zero, cases) for stages, zero, cases in layouts]


LAYOUTS = {
    2: [(2, 0, ALL_SHORT)],
    3: [(3, 0, ALL_SHORT)],
    4: [(4, 0, ALL_SHORT), (2, 3, ONE_REPLICA_SHORT)],  # 4 stages; 2 stages × 2 data-parallel replicas, ZeRO-3
}


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def results(request):
    world = request.param
    return world, run_distributed(_each, world_size=world, args=(LAYOUTS[world],), timeout=60 + 30 * world)


def test_every_rank_raises_data_exhausted_at_once(results):
    from engine.pipe import DataExhausted
    assert issubclass(DataExhausted, StopIteration)  # DeepSpeed lets the iterator's StopIteration escape
    world, per_rank = results
    for layout, (stages, _, cases) in enumerate(LAYOUTS[world]):
        for rank, r in enumerate(per_rank):
            for (message, seconds, held, short), (kind, micro, _, _) in zip(r[layout]["errors"], cases, strict=True):
                told = f"stage {r[layout]['stage']}: the data iterator of rank"  # DataReadFailed
                want = {"mixed": "the micro-batches of one train_batch/eval_batch differ in nest or shape",
                        "raises": "a broken sample" if short else told,
                        "no_key": "Can't serialize TreeSpec of namedtuple" if short else told,
                        }.get(kind, f"stage {r[layout]['stage']}: the pipeline's data iterator ran out "
                                    f"after {micro} of the {GAS} micro-batches")
                assert message.startswith(want), (rank, message)
                assert "\n" not in message and seconds < 10
                assert not held  # ZeRO-3 gathered nothing for the batch that did not run


def test_training_on_after_the_exhausted_calls_is_bit_for_bit_a_run_without_them(results):
    world, per_rank = results
    for layout in range(len(LAYOUTS[world])):
        for r in per_rank:
            assert_trained_alike(r[layout]["a"], r[layout]["b"], r[layout]["losses"])
