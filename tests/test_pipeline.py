"""Pipeline parallelism (engine/pipe): every schedule on 2 and 4 stages equals single-process SGD on
the global batch after 5 steps (no clipping, so a wrong gradient scale — a missing 1/m, a doubled
tied gradient — shows in the weights), with accumulation and tied weights; the API's errors; the
schedule accounting (idle slots from the schedule's own actions vs the bubble formula; activations
held per stage measured with saved-tensor hooks)."""
from __future__ import annotations

import pytest
import torch

from engine.pipe.schedule import formula_bubble, idle_fractions
from tests.harness import run_distributed
from tests.models import micro_batches
from tests.pipe_models import (Reference, dict_specs, global_batches, lm_loss, mlp_specs, mse, reference_params,
                               reference_sgd, tied_specs, varying_length_batches)

LR, MICRO, STEPS = 0.1, 2, 5


def _config(schedule: str, gas: int, zero: int = 0, extra: dict | None = None) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
            "optimizer": {"type": "SGD", "params": {"lr": LR}}, "zero_allow_untested_optimizer": True,
            "gradient_clipping": 0.0,  # DeepSpeed's default clips at 1.0: a clip would hide a wrong gradient scale
            "pipeline": {"schedule": schedule}, "zero_optimization": {"stage": zero}, **(extra or {})}


def _specs(tied: bool, n_layers: int):
    return tied_specs(n_layers - 2) if tied else mlp_specs(n_layers)


def _train(schedule: str, stages: int, virtual: int, gas: int, tied: bool, zero: int = 0, steps: int = STEPS,
           n_layers: int = 8):
    import engine
    from engine.pipe import PipelineModule
    specs = _specs(tied, n_layers)
    pm = PipelineModule(specs, num_stages=stages, loss_fn=lm_loss if tied else mse, seed_layers=True,
                        partition_method="uniform", virtual_stages=virtual)
    eng, *_ = engine.initialize(model=pm, config=_config(schedule, gas, zero))
    dp, dp_rank = eng.comm.world_size, eng.comm.rank
    losses = []
    for x, y in global_batches(steps, MICRO * gas * dp, tied):
        losses.append(float(eng.train_batch(iter(list(micro_batches(x, y, dp_rank, dp, gas))))))
    actions = eng.schedule_actions()
    idle = idle_fractions(actions, stages * virtual)[eng.stage_id]
    # the measured bubble of the last batch (stage_clock.py) and what its clock timed: every action, and
    # on the last stage every micro-batch's loss; with this rank's own-span fraction, edges and busy time
    expected = len(actions[eng.stage_id]) + (gas if eng.is_last_stage else 0)
    measured = (eng.measured_idle()[eng.stage_id], eng._clock.intervals(), expected, eng.stage_idle_fraction(),
                *eng.idle_record()[1:])
    early = [None if st.early is None else st.early.count for _, entry in eng._built.items() for st in entry[0]]
    return {n: p.detach().clone() for n, p in pm.named_parameters()}, losses, idle, measured, early


def _check_against_reference(results, tied: bool, gas: int, dp: int, n_layers: int = 8):
    specs = _specs(tied, n_layers)
    ref, ref_losses = reference_sgd(specs, global_batches(STEPS, MICRO * gas * dp, tied), lm_loss if tied else mse,
                                    LR, STEPS)
    want = reference_params(ref)
    seen = set()
    for params, losses, *_ in results:
        assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)  # every stage returns the loss
        for name, p in params.items():
            torch.testing.assert_close(p, want[name], rtol=1e-5, atol=1e-6, msg=f"parameter {name}")
            seen.add(name)
    assert seen == set(want)  # the stages together hold the whole model
    # the model moved: the comparison is not between two untouched initialisations
    init = reference_params(Reference(specs))
    assert any(not torch.allclose(init[n], want[n]) for n in want)


def _train_each(stages: int, cases: list):
    """Several runs in one set of processes (spawning and rendezvous cost more than the training)."""
    return [_train(schedule, stages, virtual, gas, tied, n_layers=n_layers) for schedule, virtual, gas, tied, n_layers in cases]


# (schedule, virtual stages per rank, accumulation steps = micro-batches, tied weights, layers)
CASES = {
    2: [("1f1b", 1, 4, True, 6), ("gpipe", 1, 3, False, 8), ("interleaved_1f1b", 2, 4, True, 8),
        ("zero_bubble", 2, 4, True, 8), ("eager_1f1b", 1, 5, True, 6), ("zb_h1", 1, 5, True, 6),
        ("zb_h1", 1, 1, False, 6)],  # tied: 3-d activations leave nn.Linear as views
    4: [("1f1b", 1, 4, True, 8), ("gpipe", 1, 2, True, 8), ("interleaved_1f1b", 2, 4, False, 16),
        ("zero_bubble", 2, 4, False, 16), ("eager_1f1b", 1, 8, True, 8), ("zb_h1", 1, 6, True, 8),
        ("zb_h1", 1, 3, False, 8)],  # eager: stage 0 runs 7 forwards first; zb_h1 at m ≥ p and m < p
}


def _two_rank_checks():
    """Every 2-rank check of this file in one spawn (each spawn costs a torch import and rendezvous per rank)."""
    return {"schedules": _train_each(2, CASES[2]), "peaks": _activation_peaks(), "dicts": _dicts_and_lengths(),
            "batchnorm": _batchnorm_statistics(), "epochs": _training_data_epochs(), "demo": _pipeline_demo(),
            "untied": _untied_warnings(), "checkpointed": _checkpointed_split_backward()}


def _checkpointed_split_backward() -> dict:
    """zb_h1 with activation_checkpoint_interval=2: the last stage's backward runs in two autograd passes
    (input gradient, then weights) over checkpointed regions; 3 steps of 4 micro-batches, the losses and
    this stage's parameters."""
    import engine
    from engine.pipe import PipelineModule
    pm = PipelineModule(mlp_specs(8), num_stages=2, loss_fn=mse, seed_layers=True, partition_method="uniform",
                        activation_checkpoint_interval=2)
    eng, *_ = engine.initialize(model=pm, config=_config("zb_h1", 4))
    losses = [float(eng.train_batch(iter(list(micro_batches(x, y, 0, 1, 4)))))
              for x, y in global_batches(3, MICRO * 4, False)]
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in pm.named_parameters()}}


def test_zb_h1_with_activation_checkpointing_matches_single_process(two_rank_results):
    ref, ref_losses = reference_sgd(mlp_specs(8), global_batches(3, MICRO * 4, False), mse, LR, 3)
    want = reference_params(ref)
    seen = set()
    for r in (res["checkpointed"] for res in two_rank_results):
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
        for name, p in r["params"].items():
            torch.testing.assert_close(p, want[name], rtol=1e-5, atol=1e-6, msg=name)
            seen.add(name)
    assert seen == set(want)


def _untied_warnings() -> list:
    """An ALBERT-style block tied across both stages (TiedLayerSpec's default ties "weight" only), and
    the same with its bias listed: the warnings each build gave on this rank."""
    import warnings

    from engine.pipe import PipelineModule, TiedLayerSpec
    said = []
    for attrs in ("weight", ["weight", "bias"]):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            PipelineModule([TiedLayerSpec("blk", torch.nn.Linear, 4, 4, tied_weight_attr=attrs) for _ in range(4)],
                           num_stages=2, loss_fn=torch.nn.functional.mse_loss, partition_method="uniform")
        said.append([str(w.message) for w in caught if "tied_weight_attr" in str(w.message)])
    return said


def _four_rank_checks():
    """Every 4-rank check of this file in one spawn."""
    return {"schedules": _train_each(4, CASES[4]), "parameterless": _parameterless_stages()}


@pytest.fixture(scope="module")
def four_rank_results():
    return run_distributed(_four_rank_checks, world_size=4, timeout=300)


def _pipeline_demo() -> list:
    """examples/train_gpt_pipe.py's main() from sample_configs/pipe2.json and pipe2_zb_h1.json, in this
    spawn (a launch of its own costs two more torch imports), on a small GPT; it raises SystemExit if the
    loss does not fall."""
    from examples import train_gpt_pipe
    default = train_gpt_pipe.DEFAULT_CONFIG  # sample_configs/pipe2.json
    return [train_gpt_pipe.main(["--deepspeed_config", str(config), "--steps", "10", "--layers", "2",
                                 "--d-model", "64", "--seq-len", "32", "--threads", "1"])
            for config in (default, default.with_name("pipe2_zb_h1.json"))]


def test_the_pipeline_demo_trains_from_its_sample_config(two_rank_results):
    assert [r["demo"] for r in two_rank_results] == [[0, 0], [0, 0]]


@pytest.fixture(scope="module")
def two_rank_results():
    return run_distributed(_two_rank_checks, world_size=2, timeout=300)


@pytest.mark.parametrize("stages", [2, 4])
def test_every_schedule_matches_single_process(stages, request):
    if stages == 2:
        per_rank = [r["schedules"] for r in request.getfixturevalue("two_rank_results")]
    else:
        per_rank = [r["schedules"] for r in request.getfixturevalue("four_rank_results")]
    idle = {}
    for k, (schedule, _, gas, tied, n_layers) in enumerate(CASES[stages]):
        _check_against_reference([r[k] for r in per_rank], tied, gas, dp=1, n_layers=n_layers)
        idle[schedule, gas] = [r[k][2] for r in per_rank]
    # the wall-clock bubble's values are the benchmark's (no timing assertions); here its bookkeeping: each
    # action timed, and each stage's fraction taken over the pipeline's span (the union of the stages' runs,
    # stage_clock.py's note), not its own, so never below the own-span one
    for k in range(len(CASES[stages])):
        clocks = [r[k][3] for r in per_rank]
        span = max(c[4][1] for c in clocks) - min(c[4][0] for c in clocks)
        for fraction, timed, expected, own, _, busy in clocks:
            assert timed == expected and 0.0 <= own <= fraction <= 1.0
            assert fraction == pytest.approx(1.0 - busy / span, rel=1e-12)
    # one chunk per rank: every receive after a step's first in each direction posted a micro-batch early
    # (engine/pipe/early_receive.py), activations on all but the first stage, gradients on all but the last
    for k, (schedule, virtual, gas, _, _) in enumerate(CASES[stages]):
        for rank, r in enumerate(per_rank):
            directions = (rank > 0) + (rank < stages - 1)
            assert r[k][4] == ([STEPS * (gas - 1) * directions] if virtual == 1 else [None] * virtual), (schedule, rank)
    # Schedule accounting: the idle slots of the executed action lists, per stage, vs the formula.
    for (schedule, m), fractions in idle.items():  # eager_1f1b.py's note: the extra forwards move idle time
        if schedule in ("1f1b", "eager_1f1b", "gpipe", "zb_h1"):
            assert fractions == pytest.approx([formula_bubble(schedule, stages, m)] * stages, abs=1e-9), schedule
    plain = formula_bubble("1f1b", stages, 4)
    assert max(idle["interleaved_1f1b", 4]) < plain
    assert max(idle["zero_bubble", 4]) < max(idle["interleaved_1f1b", 4])
    assert formula_bubble("zb_h1", stages, 4) < plain  # a third of 1F1B's at m ≥ p (zb_h1.py's note)


EPOCH_ROWS, EPOCH_STEPS = 8, 5  # 2 batches of 2 micro-batches an epoch: 5 steps end 2 epochs and start a third


def _epoch_data():
    from torch.utils.data import TensorDataset
    (x, y), = global_batches(1, EPOCH_ROWS, False, seed=7)
    return TensorDataset(x, y)


def _training_data_epochs():
    """train_batch() with no iterator, on the loader initialize built from training_data, past its epoch
    (it repeats, as DeepSpeed's RepeatingLoader); the micro-batches in the loader's order, for the reference."""
    import engine
    from engine.data import DistributedDataLoader
    from engine.pipe import PipelineModule
    pm = PipelineModule(mlp_specs(6), num_stages=2, loss_fn=mse, seed_layers=True, partition_method="uniform")
    eng, *_ = engine.initialize(model=pm, config=_config("1f1b", 2), training_data=_epoch_data())
    losses = [float(eng.train_batch()) for _ in range(EPOCH_STEPS)]
    order = DistributedDataLoader(_epoch_data(), MICRO, 0, 1, eng.config.seed)
    micro = [b for _ in range(3) for b in order][:2 * EPOCH_STEPS]
    return {n: p.detach().clone() for n, p in pm.named_parameters()}, losses, micro


def test_train_batch_without_an_iterator_repeats_the_training_data_loader(two_rank_results):
    micro = two_rank_results[0]["epochs"][2]
    batches = [(torch.cat([micro[i][0], micro[i + 1][0]]), torch.cat([micro[i][1], micro[i + 1][1]]))
               for i in range(0, len(micro), 2)]
    ref, ref_losses = reference_sgd(mlp_specs(6), batches, mse, LR, EPOCH_STEPS)
    want = reference_params(ref)
    for params, losses, _ in (r["epochs"] for r in two_rank_results):
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        for name, p in params.items():
            torch.testing.assert_close(p, want[name], rtol=1e-5, atol=1e-6, msg=name)


def _parameterless_specs() -> list:
    import torch.nn as nn
    from engine.pipe import LayerSpec
    from tests.pipe_models import D
    return [LayerSpec(nn.Linear, D, D), nn.Tanh(), nn.Tanh(), LayerSpec(nn.Linear, D, D)]  # uniform: 1 layer a stage


def _parameterless_stages():
    """Stages 1 and 2 hold only Tanh: no parameter to optimise (ZeRO-1), yet in every step's collectives."""
    import engine
    from engine.pipe import PipelineModule
    pm = PipelineModule(_parameterless_specs(), num_stages=4, loss_fn=mse, seed_layers=True,
                        partition_method="uniform")
    eng, *_ = engine.initialize(model=pm, config=_config("1f1b", 2, zero=1))
    losses = [float(eng.train_batch(iter(list(micro_batches(x, y, 0, 1, 2)))))
              for x, y in global_batches(3, MICRO * 2, False)]
    return {n: p.detach().clone() for n, p in pm.named_parameters()}, losses


def test_stages_without_parameters_train_as_single_process(four_rank_results):
    results = [r["parameterless"] for r in four_rank_results]
    assert [len(params) for params, _ in results] == [2, 0, 0, 2]
    ref, ref_losses = reference_sgd(_parameterless_specs(), global_batches(3, MICRO * 2, False), mse, LR, 3)
    want = reference_params(ref)
    for params, losses in results:
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        for name, p in params.items():
            torch.testing.assert_close(p, want[name], rtol=1e-5, atol=1e-6, msg=name)


def _activation_peaks():
    """Peak bytes of activations autograd holds on this stage during a train_batch, per schedule and m."""
    import engine
    from engine.checkpointing import SavedActivationProbe
    from engine.pipe import PipelineModule
    peaks = {}
    for schedule, m, interval in (("1f1b", 1, 0), ("1f1b", 4, 0), ("gpipe", 4, 0), ("1f1b", 4, 2), ("eager_1f1b", 4, 0),
                                     ("zb_h1", 4, 0)):
        pm = PipelineModule(mlp_specs(8), num_stages=2, loss_fn=mse, seed_layers=True, partition_method="uniform",
                            activation_checkpoint_interval=interval)
        eng, *_ = engine.initialize(model=pm, config=_config(schedule, m))
        # each micro-batch its own storage: the probe counts storages, and slices of one batch share one
        batches = [[(x.clone(), y.clone()) for x, y in micro_batches(*b, 0, 1, m)]
                   for b in global_batches(2, MICRO * m, False)]
        eng.train_batch(iter(batches[0]))  # builds the stages (probe.py)
        with SavedActivationProbe(pm.parameters()) as probe:
            eng.train_batch(iter(batches[1]))
        peaks[(schedule, m, interval)] = probe.peak_bytes
    return peaks


def test_1f1b_holds_at_most_p_micro_batches_eager_2p_less_1_zb_h1_p_gpipe_m_and_checkpointing_less(two_rank_results):
    for stage, peaks in enumerate(r["peaks"] for r in two_rank_results):
        one = peaks[("1f1b", 1, 0)]
        assert one > 0
        assert peaks[("1f1b", 4, 0)] == min(2 - stage, 4) * one  # stage 0 holds p = 2, the last stage 1
        assert peaks[("gpipe", 4, 0)] == 4 * one
        assert peaks[("eager_1f1b", 4, 0)] == (3 if stage == 0 else 1) * one  # 2(p − s) − 1 (eager_1f1b.py)
        assert peaks[("zb_h1", 4, 0)] == 2 * one  # p on every stage: a micro-batch waits for its W (zb_h1.py)
        # activation_checkpoint_interval=2: each [Linear, Tanh] pair keeps only its input. Stage 0 holds
        # two micro-batches of pairs: less. The last stage's loss keeps as much as the pairs saved: no more.
        if stage == 0:
            assert 0 < peaks[("1f1b", 4, 2)] < peaks[("1f1b", 4, 0)]
        else:
            assert 0 < peaks[("1f1b", 4, 2)] <= peaks[("1f1b", 4, 0)]


def _batchnorm_specs() -> list:
    import torch.nn as nn
    from engine.pipe import LayerSpec
    from tests.pipe_models import D
    block = [LayerSpec(nn.Linear, D, D), LayerSpec(nn.BatchNorm1d, D), nn.Tanh()]
    return [*block, *block, LayerSpec(nn.Linear, D, D)]


# micro-batch rows per step: the third step's new shape makes the engine probe a second signature
BATCHNORM_ROWS = (MICRO, MICRO, MICRO + 1)


def _batchnorm_batches():
    return [global_batches(1, rows * 2, False, seed=step)[0] for step, rows in enumerate(BATCHNORM_ROWS)]


def _batchnorm_statistics():
    """BatchNorm on both stages, 2 micro-batches a step, two input signatures (engine/pipe/probe.py's
    note: the probe's forward must not count as a batch)."""
    import engine
    from engine.pipe import PipelineModule
    pm = PipelineModule(_batchnorm_specs(), num_stages=2, loss_fn=mse, seed_layers=True, partition_method="uniform")
    eng, *_ = engine.initialize(model=pm, config=_config("1f1b", 2))
    losses = [float(eng.train_batch(iter(list(micro_batches(x, y, 0, 1, 2))))) for x, y in _batchnorm_batches()]
    return ({n: b.clone() for n, b in pm.named_buffers()}, {n: p.detach().clone() for n, p in pm.named_parameters()},
            losses)


def test_batchnorm_statistics_count_each_micro_batch_once(two_rank_results):
    """Running mean/var and num_batches_tracked after 3 steps equal single-process accumulation over the
    same micro-batches (one train-mode forward each), however many signatures the stages were probed for."""
    model = Reference(_batchnorm_specs())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ref_losses = []
    for x, y in _batchnorm_batches():
        total = 0.0
        for xm, ym in micro_batches(x, y, 0, 1, 2):
            loss = mse(model(xm), ym) / 2
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        ref_losses.append(total)
    buffers = {f"{k}.{n}": b for k, m in model.named.items() for n, b in m.named_buffers()}
    params = reference_params(model)
    seen = set()
    for got_buffers, got_params, losses in (r["batchnorm"] for r in two_rank_results):
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        for name, b in got_buffers.items():
            torch.testing.assert_close(b, buffers[name], rtol=1e-5, atol=1e-6, msg=f"buffer {name}")
            seen.add(name)
        for name, p in got_params.items():
            torch.testing.assert_close(p, params[name], rtol=1e-5, atol=1e-6, msg=f"parameter {name}")
    assert seen == set(buffers) and buffers["1.num_batches_tracked"] == 2 * len(BATCHNORM_ROWS)


def test_the_probe_puts_back_buffers_and_model_parallel_rng_streams():
    """engine/pipe/probe.py's note, on one chunk in this process: a BatchNorm and a dropout drawn from the
    tracked model-parallel stream (as ParallelSelfAttention's) run in the probe and leave no trace."""
    from engine.checkpointing import get_cuda_rng_tracker
    from engine.pipe.probe import chunk_examples

    class Chunk(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.BatchNorm1d(4)

        def forward(self, x):
            with get_cuda_rng_tracker().fork():
                return (torch.nn.functional.dropout(self.norm(x), 0.5),)

    tracker = get_cuda_rng_tracker()
    kept = dict(tracker.states), set(tracker.seeds)
    tracker.reset()
    tracker.add("model-parallel-rng", 99)
    try:
        chunk = Chunk().train()
        before = [b.clone() for b in chunk.buffers()], tracker.get_states()["model-parallel-rng"].clone()
        chunk_examples({0: chunk}, (torch.randn(3, 4),), 1, 1, None, 0, torch.device("cpu"), True)
        for b, was in zip(chunk.buffers(), before[0]):
            assert torch.equal(b, was)
        assert torch.equal(tracker.get_states()["model-parallel-rng"], before[1])
    finally:
        tracker.states, tracker.seeds = kept


def _dicts_and_lengths():
    """Dict boundaries (int mask, no-grad tensor, constant) with changing sequence lengths; eval; errors."""
    import engine
    from engine.pipe import PipelineModule
    pm = PipelineModule(dict_specs(), num_stages=2, loss_fn=lm_loss, seed_layers=True, partition_method="uniform")
    eng, *_ = engine.initialize(model=pm, config=_config("1f1b", 2))
    losses = [float(eng.train_batch(iter(list(micro_batches(x, y, 0, 1, 2)))))
              for x, y in varying_length_batches(STEPS, MICRO * 2)]
    x, y = varying_length_batches(STEPS + 1, MICRO * 2)[STEPS]
    eval_loss = float(eng.eval_batch(iter(list(micro_batches(x, y, 0, 1, 2)))))
    errors = []
    for call in (lambda: eng(x), lambda: eng.backward(None), lambda: eng.step()):
        try:
            call()
        except RuntimeError as err:
            errors.append(str(err))
    (x5, y5), (x7, y7) = varying_length_batches(2, MICRO)  # one batch, micro-batches of lengths 5 and 7
    try:  # refused on every stage (the first tells the others), before anything runs
        eng.train_batch(iter([(x5, y5), (x7, y7)]))
        errors.append("accepted")
    except ValueError as err:
        errors.append(str(err))
    return {n: p.detach().clone() for n, p in pm.named_parameters()}, losses, eval_loss, errors


def test_dicts_masks_and_changing_lengths_cross_stages(two_rank_results):
    per_rank = [r["dicts"] for r in two_rank_results]
    batches = varying_length_batches(STEPS + 1, MICRO * 2)
    ref, ref_losses = reference_sgd(dict_specs(), batches, lm_loss, LR, STEPS)
    want = reference_params(ref)
    with torch.no_grad():
        ref_eval = float(lm_loss(ref(batches[STEPS][0]), batches[STEPS][1]))
    for params, losses, eval_loss, errors in per_rank:
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        assert eval_loss == pytest.approx(ref_eval, rel=1e-5)
        for name, p in params.items():
            torch.testing.assert_close(p, want[name], rtol=1e-5, atol=1e-6, msg=name)
        assert len(errors) == 4 and all("train_batch" in e for e in errors[:3])
        assert "micro-batches of one train_batch/eval_batch differ in nest or shape" in errors[3]


def test_the_measured_bubble_is_the_span_outside_computations():
    """engine/pipe/stage_clock.py's arithmetic on a scripted clock: a step of 10 s with computations of 2 s
    and 1 s (a loss nested in the second counted once) is idle 1 - 3/10 of its own span, and 1 - 3/12 of
    a pipeline span that another rank's run stretches to 12 s; edges from two hosts are refused."""
    from engine.pipe.stage_clock import StageClock, pipeline_idle
    ticks = iter([0.0, 1.0, 3.0, 4.0, 5.0, 10.0])
    clock = StageClock(torch.device("cpu"), timer=lambda: next(ticks))
    clock.start_step()  # 0
    with clock.busy():  # 1 .. 3
        pass
    with clock.busy():  # 4 .. 5; the nested block reads no clock
        with clock.busy():
            pass
    clock.stop_step()  # 10
    assert clock.intervals() == 2 and clock.idle_fraction() == pytest.approx(0.7)
    with pytest.raises(RuntimeError, match="before a whole step"):
        StageClock(torch.device("cpu")).idle_fraction()
    # over the pipeline's span: this 0..10 s run and another rank's 2..12 s one computing 6 s make a 12 s span
    assert clock.edges() == (0.0, 10.0) and clock.busy_seconds() == pytest.approx(3.0)
    ranks = [("h", clock.edges(), clock.busy_seconds()), ("h", (2.0, 12.0), 6.0)]
    assert pipeline_idle(ranks) == pytest.approx([1 - 3 / 12, 1 - 6 / 12])
    with pytest.raises(RuntimeError, match="2 hosts, whose clocks are not comparable"):
        pipeline_idle([ranks[0], ("other", (2.0, 12.0), 6.0)])


def test_a_chunk_whose_output_nest_depends_on_values_is_an_error():
    """What crosses a boundary is probed once per input signature (engine/pipe/boundary.py's note): a
    stage whose output structure then changes with the values is told so, not misread."""
    from engine.pipe import boundary
    from engine.pipe.engine import _ChunkModule

    from types import SimpleNamespace

    class TwoChunks:
        num_stages, virtual_stages, _forward_funcs = 2, 1, {0: []}
        process_groups = SimpleNamespace(topology=SimpleNamespace(model=1))  # no tensor-parallel peers

        def run_chunk(self, chunk, x):
            return {"h": x, "positive": bool(x.sum() > 0)}

    chunk = _ChunkModule(TwoChunks(), 0, torch.device("cpu"))
    chunk.in_structure = boundary.flatten(torch.zeros(2))[0]
    assert chunk(torch.ones(2))[0].tolist() == [1.0, 1.0]  # the probe's run records the structure
    chunk(2 * torch.ones(2))  # the same structure again
    with pytest.raises(ValueError, match="different nest or constants"):
        chunk(-torch.ones(2))


def test_a_receive_left_posted_by_a_failed_step_stops_the_next():
    """engine/pipe/early_receive.py: a step that raised inside the schedule can leave a receive posted, into
    which the next step's first message would land; the next step refuses to start instead."""
    from types import SimpleNamespace

    from engine.pipe.early_receive import EarlyReceives
    early = EarlyReceives(SimpleNamespace(stage_index=1))
    early.start_step()  # nothing posted: the step starts
    early.works[("forward", 3)] = []
    with pytest.raises(RuntimeError, match=r"stage 1: an earlier train_batch/eval_batch stopped inside the schedule"):
        early.start_step()


def test_a_tied_module_s_untied_parameters_are_said(two_rank_results):
    """Rank 0 (the first holder) names the bias each stage trains alone; listing it, or rank 1, says nothing."""
    first, second = (r["untied"] for r in two_rank_results)
    assert len(first[0]) == 1 and "bias not in tied_weight_attr" in first[0][0], first
    assert first[1] == [] and second == [[], []], (first, second)


def test_eager_1f1b_is_refused_where_its_early_sends_could_deadlock():
    from engine.pipe.schedule import schedule_class
    assert schedule_class("eager_1f1b", 1, "gloo")[0].__name__ == "Eager1F1B"
    with pytest.raises(ValueError, match=r'pipeline.schedule: "eager_1f1b" runs on gloo only.*use "1f1b"'):
        schedule_class("eager_1f1b", 1, "nccl")
