"""Checkpoints of model-parallel runs: pipeline grids (engine/checkpoint/placement.py) and tensor-parallel
shards (engine/checkpoint/tensor_shards.py), saved once and read by several layouts.

Pipeline: 2 pipeline stages × 2 data-parallel ranks save through `checkpoint.save_interval` at step
SAVE_AT and train to STEPS; the checkpoint, loaded at 4 data-parallel ranks (a one-stage
PipelineModule, the same parameter names) and at 1 process (through `checkpoint.auto_resume`),
continues with the same steps to the same weights and losses. SGD with momentum and ZeRO-1, no
clipping: the update is linear in the gradient (a wrong scale shows) and the momentum buffer,
partitioned over the data axis, must come back row for row. The global batch is the same at every
layout (micro-batch × data ranks constant), so only the reductions' summation order differs: fp32
tolerance rtol 1e-5. `dstrain ckpt info` reads the checkpoint.

Tensor parallel: a tiny GPT through `tensor_parallel.autotp_size: 2` on 2 model × 2 data ranks
(fused q|k|v column-parallel with 3 sections, row-parallel projections, replicated norms, biases and
tied embeddings) saves at step SAVE_AT. Loaded into the same grid it continues bit for bit; loaded
into 1 process (a dense model), into 2 model × 1 data and into 4 model × 1 data ranks (degree 2 → 4),
and a checkpoint the dense process saves loaded at 2 model ranks (degree 1 → 2), each continues
equal to a dense single-process reference (SGD with momentum on the global batch, no clipping: a
wrong shard or a wrong gradient scale moves the weights), losses and reported gradient norms
included. The consolidate tool turns the tensor-parallel checkpoint into the dense model's state
dict. The same GPT at ZeRO-2 (2 model × 2 data) loads into 1 process and into 2 model × 1 data; at
ZeRO-3 (2 × 2, matrices partitioned over the data axis and gathered) into 1 process at ZeRO-3, into
2 model × 1 data at ZeRO-2 and into 2 × 2 at ZeRO-2, and the ZeRO-2 checkpoint into 2 × 2 at ZeRO-3.
HF GPT-2 (`Conv1D` projections, weights stored (in, out)) the same way at `autotp_size: 2`: loaded into
the plain Conv1D model in 1 process, which saves a dense checkpoint that loads at autotp 2 (degree
2 → 1 → 2), and at 4 model ranks (2 → 4); every weight right after each load equals the dense
reference's at the save, and the consolidated state dict loads into the plain model. The same
checkpoint rewritten as before the `transposed` flag still loads at autotp 2 and is refused by name
for the dense Conv1D model. The tiny GPT with a column- and a row-parallel
weight frozen saves (each model coordinate its own frozen shard) and loads at 1 process and at 2 × 1.

Pipeline × tensor parallel: examples/gpt_pipe.py's GPT as 2 stages that AutoTP shards over 2 model
ranks (SGD with momentum, `gradient_clipping: 0.0`) saves at step SAVE_AT; loaded into 1 process (one
dense stage) and into 2 pipe × 1 model, the next step equals the dense layer list's single-process run;
the same with the stages built from engine.tensor_parallel's layers, loaded into 1 process.
Every job runs in one spawn of 4 processes, as successive worlds (`_every_layout`).
"""
from __future__ import annotations

import json
import traceback
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from tests.harness import run_distributed
from tests.models import micro_batches
from tests.pipe_models import global_batches, lm_loss, tied_specs
from tests.worlds import new_world

LR, MOMENTUM, GAS, GLOBAL, SAVE_AT, STEPS = 0.1, 0.9, 2, 8, 2, 3  # STEPS < 2 × SAVE_AT: no second periodic save
TAG = f"global_step{SAVE_AT}"


def _guarded(check, *args):
    """A case's result, or its traceback: one broken case fails its own tests, not the others' (the
    cases fail deterministically, so every rank leaves a case at the same collective)."""
    try:
        return check(*args)
    except Exception:  # noqa: BLE001 - reported by the test that reads this case
        return {"error": traceback.format_exc()}


def _checked(result):
    assert not (isinstance(result, dict) and "error" in result), result["error"]
    return result


# -- pipeline: 2 pipe × 2 data -------------------------------------------------------------------------
def _config(save_dir: str, dp: int, extra: dict | None = None, zero: int = 1) -> dict:
    # ZeRO-3: every parameter partitioned over the data axis (engine/pipe/zero3.py)
    section = {"stage": zero, **({"stage3_param_persistence_threshold": 0} if zero == 3 else {})}
    return {"train_micro_batch_size_per_gpu": GLOBAL // (GAS * dp), "gradient_accumulation_steps": GAS,
            "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": MOMENTUM}},
            "zero_allow_untested_optimizer": True, "zero_optimization": section,
            "checkpoint": {"save_dir": save_dir, **(extra or {})}}


def _engine(stages: int, save_dir: str, dp: int, extra: dict | None = None, zero: int = 1):
    import engine
    from engine.pipe import PipelineModule
    pm = PipelineModule(tied_specs(2), num_stages=stages, loss_fn=lm_loss, seed_layers=True,
                        partition_method="uniform")
    eng, *_ = engine.initialize(model=pm, config=_config(save_dir, dp, extra, zero))
    return eng, pm


def _train(eng, steps: range) -> list[float]:
    dp, dp_rank = eng.comm.world_size, eng.comm.rank
    batches = global_batches(STEPS, GLOBAL, True)
    return [float(eng.train_batch(iter(list(micro_batches(*batches[s], dp_rank, dp, GAS))))) for s in steps]


def _params(pm) -> dict[str, torch.Tensor]:
    import engine
    with engine.zero.GatheredParameters(list(pm.parameters())):  # ZeRO-3: placeholders between steps
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
    eng4.destroy()
    return uninterrupted, at_save, (_params(pm4), losses4), steps_loaded, path


def _pipe_zero3_save_and_continue(save_dir: str):
    """2 pipe × 2 data at ZeRO-3: save at step SAVE_AT, continue to STEPS."""
    eng, pm = _engine(2, save_dir, dp=2, zero=3)
    _train(eng, range(SAVE_AT))
    eng.save_checkpoint(save_dir)
    losses = _train(eng, range(SAVE_AT, STEPS))
    result = (_params(pm), losses, eng.stage_id)
    eng.destroy()
    return result


def _pipe_load_in_one_process(save_dir: str, zero: int):
    eng, pm = _engine(1, save_dir, dp=1, zero=zero)
    eng.load_checkpoint(save_dir)
    losses = _train(eng, range(SAVE_AT, STEPS))
    result = (_params(pm), losses, eng.global_steps)
    eng.destroy()
    return result


def _resume_in_one_process(save_dir: str):
    eng, pm = _engine(1, save_dir, dp=1, extra={"auto_resume": True})
    steps_loaded = eng.global_steps
    losses = _train(eng, range(SAVE_AT, STEPS))
    eng.destroy()
    return _params(pm), losses, steps_loaded


# -- tensor parallel: 2 model × 2 data -------------------------------------------------------------------
TP_LR, TP_ATOL = 0.5, 1e-5  # summation order only (a split matmul's two half-sums); measured below 1e-6


def _tiny_gpt():
    from examples.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=32, seq_len=8, n_layer=1, n_head=4, d_model=16))  # 4 heads: degree 4


def _tiny_hf_gpt2():
    """HF's GPT-2 (Conv1D projections, (in, out) weights), no dropout: the AutoTP route DeepSpeed users take."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=1, n_head=4, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0))


FROZEN = ("blocks.0.fc.weight", "blocks.0.proj.weight")  # a column- and a row-parallel shard


def _frozen_gpt():
    model = _tiny_gpt()
    for name, p in model.named_parameters():
        p.requires_grad_(name not in FROZEN)
    return model


MODELS = {"gpt": _tiny_gpt, "hf": _tiny_hf_gpt2, "frozen": _frozen_gpt}


def _loss(model, kind: str, batch: torch.Tensor) -> torch.Tensor:
    x = batch[:, :-1]
    return model(input_ids=x, labels=x).loss if kind == "hf" else model(x, batch[:, 1:])  # GPT-2 shifts itself


def _tp_batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 32, (GLOBAL, 9), generator=g) for _ in range(STEPS)]


def _tp_engine(tp: int, zero: int = 1, kind: str = "gpt"):
    import torch.distributed as dist

    import engine
    data = dist.get_world_size() // tp
    cfg = {"train_micro_batch_size_per_gpu": GLOBAL // data, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "SGD", "params": {"lr": TP_LR, "momentum": MOMENTUM}},
           "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": zero}}
    if zero == 3:  # the matrices partitioned and gathered, the norms and biases kept whole
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 64
    if tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": tp}
    eng, *_ = engine.initialize(model=MODELS[kind](), config=cfg)
    eng.kind = kind  # which loss _tp_train computes
    return eng


def _tp_params(eng) -> dict:
    """name -> (this rank's tensor, (dim, parts, transposed) of a shard or None); at ZeRO-3 gathered over
    the data axis (a placeholder between uses)."""
    import engine
    from engine.tensor_parallel import is_partitioned
    def layout(p):
        return ((p.tensor_parallel_dim, p.tensor_parallel_parts, getattr(p, "tensor_parallel_transposed", False))
                if is_partitioned(p) else None)
    with engine.zero.GatheredParameters(list(eng.module.parameters())):
        return {n: (p.detach().clone(), layout(p)) for n, p in eng.module.named_parameters()}


def _tp_train(eng, steps: range) -> dict:
    """Train `steps`; this rank's losses, reported norms and parameters (shards with their layout)."""
    from engine.checkpoint.placement import coordinates
    coord, micro = coordinates(eng), GLOBAL // eng.comm.world_size
    losses, norms = [], []
    for s in steps:
        batch = _tp_batches()[s][coord.data * micro:(coord.data + 1) * micro]
        loss = _loss(eng, eng.kind, batch)
        eng.backward(loss)
        eng.step()
        losses.append(loss.item())
        norms.append(eng.get_global_grad_norm())
    return {"coord": tuple(coord), "steps": eng.global_steps, "losses": losses, "norms": norms,
            "params": _tp_params(eng)}


def _tp_save_and_resume_on_grid(save_dir: str) -> dict:
    eng = _tp_engine(2)
    _tp_train(eng, range(SAVE_AT))
    eng.save_checkpoint(save_dir)
    uninterrupted = _tp_train(eng, range(SAVE_AT, STEPS))
    eng.destroy()
    eng = _tp_engine(2)
    eng.load_checkpoint(save_dir)
    resumed = _tp_train(eng, range(SAVE_AT, STEPS))
    eng.destroy()
    return {"uninterrupted": uninterrupted, "resumed": resumed}


def _tp_load_in_one_process(save_dir: str, dense_dir: str, kind: str = "gpt") -> dict:
    """The 2 × 2 checkpoint into a dense model; it saves what it loaded, for the 1 → 2 case."""
    eng = _tp_engine(1, kind=kind)
    eng.load_checkpoint(save_dir)
    loaded = _tp_params(eng)
    eng.save_checkpoint(dense_dir)
    result = _tp_train(eng, range(SAVE_AT, STEPS))
    eng.destroy()
    return {**result, "loaded": loaded}


def _tp_load_at(save_dir: str, degree: int, zero: int = 1, kind: str = "gpt") -> dict:
    eng = _tp_engine(degree, zero, kind)
    eng.load_checkpoint(save_dir)
    loaded = _tp_params(eng)
    result = _tp_train(eng, range(SAVE_AT, STEPS))
    eng.destroy()
    return {**result, "loaded": loaded}


def _tp_save_and_continue(save_dir: str, kind: str, zero: int = 1) -> dict:
    eng = _tp_engine(2, zero, kind)
    _tp_train(eng, range(SAVE_AT))
    eng.save_checkpoint(save_dir)
    result = _tp_train(eng, range(SAVE_AT, STEPS))
    eng.destroy()
    return result


def _as_unflagged(saved: str, out: str) -> None:
    """A copy of the HF checkpoint `saved` as an earlier dstrain wrote it: Conv1D shards without the
    `transposed` flag, full shapes (out, in) (tensor_shards.py's note), manifest updated to match."""
    import shutil

    from engine.checkpoint import format as fmt
    shutil.copytree(saved, out)
    tag = Path(out) / TAG
    meta = fmt.read_json(tag / fmt.METADATA)
    for entry in meta["params"].values():
        if entry.get("tensor_parallel", {}).pop("transposed", False):
            entry["shape"] = entry["shape"][::-1]
    manifest = fmt.read_json(tag / fmt.MANIFEST)
    manifest["files"][fmt.METADATA] = fmt.write_json(tag / fmt.METADATA, meta)
    fmt.write_json(tag / fmt.MANIFEST, manifest)


def _tp_reference(kind: str = "gpt") -> dict:
    """The dense model in one process on the global batch (frozen parameters left out of the optimizer,
    as the engine leaves them): weights at SAVE_AT and STEPS, losses, norms."""
    model = MODELS[kind]()
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trained, lr=TP_LR, momentum=MOMENTUM)
    out = {"losses": [], "norms": []}
    for s, batch in enumerate(_tp_batches()):
        if s == SAVE_AT:
            out["at_save"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        loss = _loss(model, kind, batch)
        loss.backward()
        out["norms"].append(torch.nn.utils.get_total_norm([p.grad for p in trained]).item())
        opt.step()
        opt.zero_grad()
        out["losses"].append(loss.item())
    out["final"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


# -- pipeline × tensor parallel: 2 pipe × 2 model ----------------------------------------------------------
# examples/gpt_pipe.py's GPT as dense stages that AutoTP shards at initialize (autotp_size 2), saved at
# 2 pipe × 2 model and loaded at 1 process (one stage, dense) and at 2 pipe × 1 model (dense stages): the
# parameter names are the dense layer list's at every layout. The global batch is MICRO × GAS at each
# (one data rank): tests/test_pipeline_tensor_parallel.py's GPT, batches and micro-batch size.


def _pt_engine(pipe: int, model: int, zero: int = 1, layers: bool = False):
    """`layers`: the blocks built from engine.tensor_parallel's layers (Megatron's layout, at any model
    degree, 1 included), else dense blocks that AutoTP shards where model > 1."""
    import torch.distributed as dist

    import engine
    from engine.pipe import PipelineModule
    from engine.topology import Topology
    from examples.gpt_pipe import gpt_layers, gpt_loss
    from tests.test_pipeline_tensor_parallel import MICRO, _cfg
    topo = Topology.for_world(dist.get_world_size(), pipe=pipe, model=model)
    pm = PipelineModule(gpt_layers(_cfg(), tensor_parallel=layers), topology=topo, loss_fn=gpt_loss, seed_layers=True,
                        partition_method="type:BlockLayer")
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
           "optimizer": {"type": "SGD", "params": {"lr": TP_LR, "momentum": MOMENTUM}},
           "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": zero},
           "gradient_clipping": 0.0}  # the schema default clips at 1: the update would not be linear
    if model > 1 and not layers:
        cfg["tensor_parallel"] = {"autotp_size": model}
    eng, *_ = engine.initialize(model=pm, config=cfg)
    return eng, pm


def _pt_train(eng, pm, steps: range) -> dict:
    from tests.test_pipeline_tensor_parallel import _batches, _dense_name
    batches = _batches(STEPS, eng.comm.world_size)
    losses, norms = [], []
    for s in steps:
        x, y = batches[s]
        losses.append(float(eng.train_batch(iter(list(micro_batches(x, y, eng.comm.rank, eng.comm.world_size, GAS))))))
        norms.append(eng.get_global_grad_norm())
    params = {_dense_name(n): (p.detach().clone(), getattr(p, "tensor_parallel_dim", None),
                               getattr(p, "tensor_parallel_parts", 1)) for n, p in pm.named_parameters()}
    return {"coord": tuple(pm.process_groups.coord), "steps": eng.global_steps, "losses": losses, "norms": norms,
            "params": params}


def _pt_save_and_continue(save_dir: str, layers: bool = False) -> dict:
    eng, pm = _pt_engine(2, 2, layers=layers)
    _pt_train(eng, pm, range(SAVE_AT))
    eng.save_checkpoint(save_dir)
    result = _pt_train(eng, pm, range(SAVE_AT, STEPS))
    eng.destroy()
    return result


def _pt_load_at(save_dir: str, pipe: int, layers: bool = False) -> dict:
    eng, pm = _pt_engine(pipe, 1, layers=layers)
    eng.load_checkpoint(save_dir)
    result = _pt_train(eng, pm, range(SAVE_AT, STEPS))
    eng.destroy()
    return result


def _pt_reference() -> dict:
    """The dense layer list in one process (same per-layer seeds), SGD with momentum, no clipping."""
    from examples.gpt_pipe import gpt_layers, gpt_loss
    from tests.pipe_models import reference_params, reference_sgd
    from tests.test_pipeline_tensor_parallel import _batches, _cfg
    norms: list = []
    model, losses = reference_sgd(gpt_layers(_cfg()), _batches(STEPS, 1), gpt_loss, TP_LR, STEPS, norms=norms,
                                  momentum=MOMENTUM)
    return {"final": reference_params(model), "losses": losses, "norms": norms}


# -- ZeRO-2 × tensor parallel: the tiny GPT at 2 model × 2 data, ZeRO-2 -------------------------------------
# -- one spawn, three worlds ---------------------------------------------------------------------------
# The later layouts run in the same 4 processes as new worlds (tests/worlds.py): after the 4-rank jobs
# rank 0 opens a world of 1 (the single-process loads, and the dense checkpoint for 1 → 2), then ranks
# 0 and 1 open a world of 2 (rank 1 waits in its rendezvous until rank 0 has finished); ranks 2 and 3
# open worlds of 1 and stop.
DIRS = ("pipe", "tp", "dense", "pipe_tp", "pipe_tp_layers", "tp_zero2", "tp_zero3", "hf", "hf_dense", "hf_unflagged",
        "frozen", "pipe_zero3")


def _every_layout(root: str) -> dict:
    import torch.distributed as dist
    dirs = {k: f"{root}/{k}" for k in DIRS}
    rank = dist.get_rank()
    out = {"four": {"pipe": _guarded(_save_then_load_at_four_data, dirs["pipe"]),
                    "pipe_zero3": _guarded(_pipe_zero3_save_and_continue, dirs["pipe_zero3"]),
                    "tp": _guarded(_tp_save_and_resume_on_grid, dirs["tp"]),
                    "tp_4x1": _guarded(_tp_load_at, dirs["tp"], 4),
                    "pipe_tp": _guarded(_pt_save_and_continue, dirs["pipe_tp"]),
                    "pipe_tp_layers": _guarded(_pt_save_and_continue, dirs["pipe_tp_layers"], True),
                    "tp_zero2": _guarded(_tp_save_and_continue, dirs["tp_zero2"], "gpt", 2),
                    "tp_zero3": _guarded(_tp_save_and_continue, dirs["tp_zero3"], "gpt", 3),
                    "tp_zero3_at_zero2": _guarded(_tp_load_at, dirs["tp_zero3"], 2, 2),
                    "tp_zero2_at_zero3": _guarded(_tp_load_at, dirs["tp_zero2"], 2, 3),
                    "hf": _guarded(_tp_save_and_continue, dirs["hf"], "hf"),
                    "hf_4x1": _guarded(_tp_load_at, dirs["hf"], 4, 1, "hf"),
                    "frozen": _guarded(_tp_save_and_continue, dirs["frozen"], "frozen")}}
    new_world(None, 0, 1)
    if rank == 0:
        out["one"] = {"pipe": _guarded(_resume_in_one_process, dirs["pipe"]),
                      "pipe_zero3": _guarded(_pipe_load_in_one_process, dirs["pipe_zero3"], 3),
                      "pipe_zero3_at_zero1": _guarded(_pipe_load_in_one_process, dirs["pipe_zero3"], 1),
                      "tp": _guarded(_tp_load_in_one_process, dirs["tp"], dirs["dense"]),
                      "pipe_tp": _guarded(_pt_load_at, dirs["pipe_tp"], 1),
                      "pipe_tp_layers": _guarded(_pt_load_at, dirs["pipe_tp_layers"], 1, True),
                      "tp_zero2": _guarded(_tp_load_at, dirs["tp_zero2"], 1, 2),
                      "tp_zero3": _guarded(_tp_load_at, dirs["tp_zero3"], 1, 3),
                      "hf": _guarded(_tp_load_in_one_process, dirs["hf"], dirs["hf_dense"], "hf"),
                      "frozen": _guarded(_tp_load_at, dirs["frozen"], 1, 1, "frozen")}
        _as_unflagged(dirs["hf"], dirs["hf_unflagged"])
        out["one"]["hf_unflagged"] = _guarded(_tp_load_at, dirs["hf_unflagged"], 1, 1, "hf")
    if rank < 2:
        new_world(f"{root}/world_of_two", rank, 2)
        out["two"] = {"tp_2x2": _guarded(_tp_load_at, dirs["tp"], 2), "tp_dense": _guarded(_tp_load_at, dirs["dense"], 2),
                      "pipe_tp": _guarded(_pt_load_at, dirs["pipe_tp"], 2),
                      "tp_zero2": _guarded(_tp_load_at, dirs["tp_zero2"], 2, 2),
                      "tp_zero3": _guarded(_tp_load_at, dirs["tp_zero3"], 2, 2),
                      "hf_dense": _guarded(_tp_load_at, dirs["hf_dense"], 2, 1, "hf"),
                      "frozen": _guarded(_tp_load_at, dirs["frozen"], 2, 1, "frozen"),
                      "hf_unflagged": _guarded(_tp_load_at, dirs["hf_unflagged"], 2, 1, "hf")}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("model_parallel_ckpt")
    per_rank = run_distributed(_every_layout, world_size=4, args=(str(root),), timeout=400)
    return {"dirs": {k: str(root / k) for k in DIRS}, "four": [r["four"] for r in per_rank],
            "one": per_rank[0]["one"], "two": [r["two"] for r in per_rank[:2]]}


# -- pipeline tests ----------------------------------------------------------------------------------
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


@pytest.fixture(scope="module")
def pipe_runs(runs):
    per_rank = [_checked(r["pipe"]) for r in runs["four"]]
    want, want_losses = _whole([r[0] for r in per_rank])
    return per_rank, want, want_losses


def test_pipeline_save_at_two_stages_by_two_data_loads_at_four_data(pipe_runs):
    per_rank, want, want_losses = pipe_runs
    at_save, _ = _whole([(r[1], None, None) for r in per_rank])
    assert any(not torch.allclose(at_save[n], want[n]) for n in want)  # the steps after the save moved the model
    assert {r[0][2] for r in per_rank} == {0, 1}
    for params, losses in (r[2] for r in per_rank):
        _assert_same(params, want, "4 data ranks after loading")
        assert losses == pytest.approx(want_losses, rel=1e-5)
    assert {r[3] for r in per_rank} == {SAVE_AT}


def test_pipeline_checkpoint_resumes_in_one_process(runs, pipe_runs):
    _, want, want_losses = pipe_runs
    params, losses, steps_loaded = _checked(runs["one"]["pipe"])
    assert steps_loaded == SAVE_AT
    _assert_same(params, want, "1 process after auto_resume")
    assert losses == pytest.approx(want_losses, rel=1e-5)


@pytest.mark.parametrize("case", ["pipe_zero3", "pipe_zero3_at_zero1"])
def test_pipeline_zero3_checkpoint_loads_in_one_process(runs, case):
    """2 pipe × 2 data at ZeRO-3 (engine/pipe/zero3.py), saved at SAVE_AT: one process at ZeRO-3 and at
    ZeRO-1 continues to the uninterrupted run's weights and losses."""
    saved = [_checked(r["pipe_zero3"]) for r in runs["four"]]
    assert {r[2] for r in saved} == {0, 1}
    want, want_losses = _whole(saved)
    params, losses, steps = _checked(runs["one"][case])
    assert steps == STEPS
    _assert_same(params, want, f"{case}: 1 process after loading")
    assert losses == pytest.approx(want_losses, rel=1e-5)


def test_pipeline_metadata_and_ckpt_info(runs, pipe_runs, capsys):
    _, want, _ = pipe_runs
    save_dir = runs["dirs"]["pipe"]
    meta = json.loads((Path(save_dir) / TAG / "metadata.json").read_text())
    assert meta["world_size"] == 4 and meta["pipe_parallel_size"] == 2 and meta["data_parallel_size"] == 2
    assert sorted(map(tuple, meta["coordinates"])) == [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)]
    files = json.loads((Path(save_dir) / TAG / "manifest.json").read_text())["files"]
    assert sum(name.startswith("rank_") for name in files) == 4  # one file per process, no collision
    for name, entry in meta["params"].items():  # each parameter once, full shape, from one stage
        assert entry["shape"] == list(want[name].shape)
        stages = {meta["coordinates"][rank][0] for rank, _, _ in entry["fragments"]}
        assert len(stages) == 1, name

    from engine.cli import main
    capsys.readouterr()
    assert main(["ckpt", "info", save_dir]) == 0
    report = capsys.readouterr().out
    assert f"{TAG} (latest): step {SAVE_AT}, world size 4 (pipe 2 × data 2 × model 1)" in report
    assert "checksums ok" in report


# -- tensor-parallel tests -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference():
    return _tp_reference()


def _dense_slice(full: torch.Tensor, layout, model_rank: int, degree: int) -> torch.Tensor:
    """The reference's slice for a shard: the layers' own cut (test_tensor_parallel.py checks it) of the
    (out, in) matrix (a Conv1D's weight is the transpose of what the dense model holds)."""
    if layout is None:
        return full
    from engine.tensor_parallel.layers import shard
    dim, parts, transposed = layout
    return shard(full.t() if transposed else full, dim, model_rank, degree, parts)


def _assert_weights(params: dict, want: dict, model: int, degree: int, what: str) -> None:
    """Every weight of one rank (its shards, or whole parameters) against the dense model's `want`."""
    assert set(params) == set(want), what
    for name, (p, layout) in params.items():
        torch.testing.assert_close(p, _dense_slice(want[name], layout, model, degree), rtol=0, atol=TP_ATOL,
                                   msg=f"{what}: parameter {name}")


def _assert_equals_reference(result: dict, reference: dict, degree: int, what: str) -> None:
    """Weights (this rank's shards), losses (this data rank's) and norms after the steps after the save;
    where the result was loaded, every weight right after loading too."""
    model = result["coord"][2]
    assert result["steps"] == STEPS, what
    if "loaded" in result:
        _assert_weights(result["loaded"], reference["at_save"], model, degree, f"{what}, as loaded")
    _assert_weights(result["params"], reference["final"], model, degree, what)
    assert result["norms"] == pytest.approx(reference["norms"][SAVE_AT:], rel=1e-5), what


def _mean_losses(results: list[dict]) -> list[float]:
    """The global batch's loss: the mean over data ranks of each one's micro-batch loss."""
    by_data = {r["coord"][1]: r["losses"] for r in results}
    return [sum(step) / len(by_data) for step in zip(*by_data.values())]


def test_tensor_parallel_run_equals_the_dense_reference(runs, reference):
    results = [_checked(r["tp"])["uninterrupted"] for r in runs["four"]]
    assert sorted(r["coord"] for r in results) == [(0, d, m) for d in range(2) for m in range(2)]
    for r in results:
        _assert_equals_reference(r, reference, 2, f"2 × 2 uninterrupted, rank {r['coord']}")
    assert _mean_losses(results) == pytest.approx(reference["losses"][SAVE_AT:], rel=1e-5)
    moved = any(not torch.allclose(reference["at_save"][n], reference["final"][n]) for n in reference["final"])
    assert moved  # the steps after the save changed the model


def test_tensor_parallel_resume_on_the_same_grid_is_bitwise(runs):
    for r in runs["four"]:
        tp = _checked(r["tp"])
        want, got = tp["uninterrupted"], tp["resumed"]
        assert got["losses"] == want["losses"] and got["norms"] == want["norms"], got["coord"]
        for name, (p, _) in want["params"].items():
            assert torch.equal(got["params"][name][0], p), (got["coord"], name)


def test_tensor_parallel_checkpoint_records_shards_with_full_shapes(runs, reference):
    tag_dir = Path(runs["dirs"]["tp"]) / TAG
    meta = json.loads((tag_dir / "metadata.json").read_text())
    assert (meta["world_size"], meta["data_parallel_size"], meta["model_parallel_size"]) == (4, 2, 2)
    assert meta["coordinates"] == [[0, d, m] for d in range(2) for m in range(2)]
    files = json.loads((tag_dir / "manifest.json").read_text())["files"]
    assert sum(name.startswith("rank_") for name in files) == 4
    expected = {"blocks.0.qkv.weight": (0, 3), "blocks.0.qkv.bias": (0, 3), "blocks.0.fc.weight": (0, 1),
                "blocks.0.fc.bias": (0, 1), "blocks.0.proj.weight": (1, 1), "blocks.0.out.weight": (1, 1)}
    params = meta["params"]
    assert set(params) == set(reference["final"])  # the tied head is an alias of tok.weight
    for name, entry in params.items():
        assert entry["shape"] == list(reference["final"][name].shape), name  # the full shape
        model_coords = {meta["coordinates"][f[0]][2] for f in entry["fragments"]}
        if name in expected:
            dim, parts = expected[name]
            assert entry["tensor_parallel"] == {"dim": dim, "parts": parts, "degree": 2}, name
            assert sorted({f[3] for f in entry["fragments"]}) == [0, 1], name
            assert all(meta["coordinates"][f[0]][2] == f[3] for f in entry["fragments"]), name
        else:  # replicated: written once, by model coordinate 0
            assert "tensor_parallel" not in entry and model_coords == {0}, name


def test_two_by_two_checkpoint_loads_in_one_process(runs, reference):
    result = _checked(runs["one"]["tp"])
    assert result["coord"] == (0, 0, 0)
    assert all(layout is None for _, layout in result["params"].values())  # a dense model
    _assert_equals_reference(result, reference, 1, "2 × 2 → 1 process")
    assert result["losses"] == pytest.approx(reference["losses"][SAVE_AT:], rel=1e-5)


@pytest.mark.parametrize("case", ["tp_2x2", "tp_dense"], ids=["2x2-to-2x1", "dense-to-2x1"])
def test_checkpoint_loads_at_two_model_ranks(runs, reference, case):
    results = [_checked(r[case]) for r in runs["two"]]
    assert sorted(r["coord"] for r in results) == [(0, 0, 0), (0, 0, 1)]
    for r in results:
        assert sum(layout is not None for _, layout in r["params"].values()) == 6
        _assert_equals_reference(r, reference, 2, f"{case}, rank {r['coord']}")
        assert r["losses"] == pytest.approx(reference["losses"][SAVE_AT:], rel=1e-5)


def test_two_by_two_checkpoint_loads_at_four_model_ranks(runs, reference):
    results = [_checked(r["tp_4x1"]) for r in runs["four"]]
    assert sorted(r["coord"] for r in results) == [(0, 0, m) for m in range(4)]
    for r in results:
        _assert_equals_reference(r, reference, 4, f"2 × 2 → 4 × 1, rank {r['coord']}")
        assert r["losses"] == pytest.approx(reference["losses"][SAVE_AT:], rel=1e-5)


def test_consolidate_gives_the_dense_model(runs, reference, tmp_path):
    from engine.checkpoint.consolidate import consolidate
    out = consolidate(runs["dirs"]["tp"], tmp_path / "dense.pt")
    state = torch.load(out, weights_only=True)
    model = _tiny_gpt()
    model.load_state_dict(state)  # strict: every key, full shapes
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), reference["at_save"][name], rtol=0, atol=TP_ATOL, msg=name)
    assert isinstance(model.head, nn.Linear) and model.head.weight is model.tok.weight


# -- frozen tensor-parallel shards: blocks.0.fc.weight (column) and blocks.0.proj.weight (row) frozen -------
@pytest.fixture(scope="module")
def frozen_reference():
    return _tp_reference("frozen")


def test_frozen_tensor_parallel_shards_save_and_load_at_every_degree(runs, frozen_reference, tmp_path):
    """Each model coordinate writes its own frozen shard (no optimizer state); loaded at 1 process and at
    2 model × 1 data, every weight is the saved one and training continues as the dense reference's;
    consolidate joins the frozen shards as it joins trainable ones."""
    from engine.checkpoint.consolidate import consolidate
    ref = frozen_reference
    assert all(torch.equal(ref["at_save"][n], ref["final"][n]) for n in FROZEN)  # frozen: never moved
    four = [_checked(r["frozen"]) for r in runs["four"]]
    for r in four:
        assert sum(r["params"][n][1] is not None for n in FROZEN) == 2, r["coord"]  # really sharded
        _assert_equals_reference(r, ref, 2, f"frozen shards, 2 × 2, rank {r['coord']}")
    meta = json.loads((Path(runs["dirs"]["frozen"]) / TAG / "metadata.json").read_text())
    for name in FROZEN:
        entry = meta["params"][name]
        assert entry["trainable"] is False and set(entry["kinds"]) == {"module"}, name
        assert entry["shape"] == list(ref["final"][name].shape) and entry["tensor_parallel"]["degree"] == 2, name
        assert sorted(f[3] for f in entry["fragments"]) == [0, 1], name  # one fragment per model coordinate
    _assert_equals_reference(_checked(runs["one"]["frozen"]), ref, 1, "frozen shards → 1 process")
    for r in (_checked(r["frozen"]) for r in runs["two"]):
        _assert_equals_reference(r, ref, 2, f"frozen shards → 2 model × 1 data, rank {r['coord']}")
    model = _tiny_gpt()
    model.load_state_dict(torch.load(consolidate(runs["dirs"]["frozen"], tmp_path / "dense.pt"), weights_only=True))
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), ref["at_save"][name], rtol=0, atol=TP_ATOL, msg=name)


# -- HF GPT-2 (Conv1D) through autotp_size: 2 ----------------------------------------------------------
CONV1D_WEIGHTS = [f"transformer.h.0.{m}.weight" for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]


@pytest.fixture(scope="module")
def hf_reference():
    return _tp_reference("hf")


def test_hf_gpt2_tensor_parallel_run_equals_the_dense_reference(runs, hf_reference):
    results = [_checked(r["hf"]) for r in runs["four"]]
    assert sorted(r["coord"] for r in results) == [(0, d, m) for d in range(2) for m in range(2)]
    for r in results:
        assert [n for n, (_, layout) in r["params"].items() if layout and layout[2]] == CONV1D_WEIGHTS, r["coord"]
        _assert_equals_reference(r, hf_reference, 2, f"HF GPT-2, 2 × 2 uninterrupted, rank {r['coord']}")
    assert _mean_losses(results) == pytest.approx(hf_reference["losses"][SAVE_AT:], rel=1e-5)


def test_hf_gpt2_autotp_checkpoint_loads_at_four_model_ranks(runs, hf_reference):
    results = [_checked(r["hf_4x1"]) for r in runs["four"]]
    assert sorted(r["coord"] for r in results) == [(0, 0, m) for m in range(4)]
    for r in results:
        _assert_equals_reference(r, hf_reference, 4, f"HF GPT-2 2 × 2 → 4 × 1, rank {r['coord']}")
        assert r["losses"] == pytest.approx(hf_reference["losses"][SAVE_AT:], rel=1e-5)


def test_hf_gpt2_checkpoint_records_conv1d_weights_as_the_dense_model_holds_them(runs, hf_reference, tmp_path):
    """Full shapes (in, out), flagged `transposed`; consolidate gives the dense HF model's state dict."""
    from transformers import GPT2LMHeadModel

    from engine.checkpoint.consolidate import consolidate
    meta = json.loads((Path(runs["dirs"]["hf"]) / TAG / "metadata.json").read_text())
    for name, want in hf_reference["at_save"].items():
        if name in meta["params"]:
            assert meta["params"][name]["shape"] == list(want.shape), name
    for name in CONV1D_WEIGHTS:
        assert meta["params"][name]["tensor_parallel"]["transposed"] is True, name
    model = _tiny_hf_gpt2()
    model.load_state_dict(torch.load(consolidate(runs["dirs"]["hf"], tmp_path / "dense.pt"), weights_only=True))
    assert isinstance(model, GPT2LMHeadModel) and model.lm_head.weight is model.transformer.wte.weight
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), hf_reference["at_save"][name], rtol=0, atol=TP_ATOL, msg=name)


def test_hf_gpt2_autotp_checkpoint_loads_into_the_dense_conv1d_model(runs, hf_reference):
    result = _checked(runs["one"]["hf"])
    assert all(layout is None for _, layout in result["params"].values())  # the plain Conv1D model
    _assert_equals_reference(result, hf_reference, 1, "HF GPT-2 2 × 2 → 1 process")
    assert result["losses"] == pytest.approx(hf_reference["losses"][SAVE_AT:], rel=1e-5)


def test_a_dense_hf_gpt2_checkpoint_loads_at_autotp_2(runs, hf_reference):
    """The checkpoint the dense model saved after loading the 2 × 2 one (degree 2 → 1 → 2)."""
    results = [_checked(r["hf_dense"]) for r in runs["two"]]
    assert sorted(r["coord"] for r in results) == [(0, 0, 0), (0, 0, 1)]
    for r in results:
        assert sum(layout is not None for _, layout in r["params"].values()) == 6  # 4 weights, 2 column biases
        _assert_equals_reference(r, hf_reference, 2, f"dense HF GPT-2 → autotp 2, rank {r['coord']}")
        assert r["losses"] == pytest.approx(hf_reference["losses"][SAVE_AT:], rel=1e-5)


def test_an_earlier_unflagged_hf_gpt2_checkpoint_loads_into_shards_and_is_refused_for_conv1d(runs, hf_reference):
    """The 2 × 2 checkpoint rewritten as before the `transposed` flag ((out, in) shapes): it loads at
    autotp 2 as it did, and the dense Conv1D model refuses it by name instead of transposing silently."""
    for r in (_checked(r["hf_unflagged"]) for r in runs["two"]):
        _assert_equals_reference(r, hf_reference, 2, f"unflagged HF GPT-2 → autotp 2, rank {r['coord']}")
    refused = runs["one"]["hf_unflagged"]["error"]
    assert "CheckpointError" in refused and "'transformer.h.0.attn.c_attn.weight' was saved as a tensor-parallel " \
        "shard in (out, in) layout without the orientation flag" in refused and "autotp_size > 1" in refused


def test_an_unflagged_shard_into_a_dense_conv1d_is_refused(tmp_path):
    """A Conv1D shard recorded (out, in) without `transposed` (tensor_shards.py's note): a square one
    would load transposed without a word, so the load into a dense Conv1D is refused by name."""
    from types import SimpleNamespace

    from transformers.pytorch_utils import Conv1D

    from engine.checkpoint import CheckpointError
    from engine.checkpoint.tensor_shards import refuse_transposed_targets
    model = nn.Module()
    model.c_proj = Conv1D(16, 16)
    layout = {"dim": 1, "parts": 1, "degree": 2}
    src = SimpleNamespace(path=tmp_path, params={"c_proj.weight": {"shape": [16, 16], "tensor_parallel": layout}})
    with pytest.raises(CheckpointError, match="'c_proj.weight' was saved as a tensor-parallel shard in \\(out, in\\)"):
        refuse_transposed_targets(model, src)
    layout["transposed"] = True  # recorded in the dense orientation: loads
    refuse_transposed_targets(model, src)
    src.params["c_proj.weight"].pop("tensor_parallel")  # a dense checkpoint of the same model loads
    refuse_transposed_targets(model, src)


# -- pipeline × tensor parallel tests --------------------------------------------------------------------
@pytest.fixture(scope="module")
def pt_reference():
    return _pt_reference()


def _assert_pt_equals_reference(results: list[dict], ref: dict, degree: int, what: str) -> None:
    """Each rank's shards (or whole parameters) after the steps after the save, its losses and norms; the
    ranks together hold the whole model."""
    from engine.tensor_parallel.layers import shard
    seen = set()
    for r in results:
        pipe, _, model = r["coord"]
        assert r["steps"] == STEPS, (what, r["coord"])
        assert r["losses"] == pytest.approx(ref["losses"][SAVE_AT:], rel=1e-5), (what, r["coord"])
        assert r["norms"] == pytest.approx(ref["norms"][SAVE_AT:], rel=1e-5), (what, r["coord"])
        for name, (p, dim, parts) in r["params"].items():
            if pipe > 0 and name == "tied_modules.embeddings.pos.weight":
                continue  # the LM head's copy of the embeddings: its position table is never used
            want = ref["final"][name] if dim is None else shard(ref["final"][name], dim, model, degree, parts)
            torch.testing.assert_close(p, want, rtol=1e-5, atol=1e-6, msg=f"{what} {r['coord']}: parameter {name}")
            seen.add(name)
    assert seen == set(ref["final"]), what


def test_pipe_by_tensor_parallel_run_equals_the_dense_reference(runs, pt_reference):
    results = [_checked(r["pipe_tp"]) for r in runs["four"]]
    assert sorted(r["coord"] for r in results) == [(p, 0, m) for p in range(2) for m in range(2)]
    assert all(any(dim is not None for _, dim, _ in r["params"].values()) for r in results)  # real shards
    _assert_pt_equals_reference(results, pt_reference, 2, "2 pipe × 2 model uninterrupted")


def test_pipe_by_tensor_parallel_checkpoint_records_stages_and_shards(runs):
    meta = json.loads((Path(runs["dirs"]["pipe_tp"]) / TAG / "metadata.json").read_text())
    assert (meta["pipe_parallel_size"], meta["data_parallel_size"], meta["model_parallel_size"]) == (2, 1, 2)
    assert meta["coordinates"] == [[p, 0, m] for p in range(2) for m in range(2)]
    sharded = {name: entry for name, entry in meta["params"].items() if "tensor_parallel" in entry}
    assert sharded and all(entry["tensor_parallel"]["degree"] == 2 for entry in sharded.values())
    for name, entry in meta["params"].items():
        stages = {meta["coordinates"][f[0]][0] for f in entry["fragments"]}
        models = {meta["coordinates"][f[0]][2] for f in entry["fragments"]}
        assert len(stages) == 1, name  # from one stage (a tied copy on the last stage is dropped)
        assert models == ({0, 1} if name in sharded else {0}), name


@pytest.mark.parametrize("layout", ["one", "two"], ids=["2x2-to-1-process", "2x2-to-2-pipe-x-1-model"])
def test_pipe_by_tensor_parallel_checkpoint_loads_at_fewer_ranks(runs, pt_reference, layout):
    results = [_checked(runs["one"]["pipe_tp"])] if layout == "one" else [_checked(r["pipe_tp"]) for r in runs["two"]]
    assert sorted(r["coord"] for r in results) == ([(0, 0, 0)] if layout == "one" else [(0, 0, 0), (1, 0, 0)])
    assert all(dim is None for r in results for _, dim, _ in r["params"].values())  # dense stages
    _assert_pt_equals_reference(results, pt_reference, 1, f"2 pipe × 2 model → {layout}")


# -- ZeRO-2 and ZeRO-3 × tensor parallel tests -----------------------------------------------------------
# ZeRO-3 saved at 2 model × 2 data loads at 1 process (ZeRO-3, a dense model), at 2 model × 1 data
# (ZeRO-2) and at 2 × 2 ZeRO-2; the ZeRO-2 checkpoint loads at 2 × 2 ZeRO-3 (resharding across stages).
@pytest.mark.parametrize("zero", [2, 3])
def test_zero_tensor_parallel_run_equals_the_dense_reference(runs, reference, zero):
    results = [_checked(r[f"tp_zero{zero}"]) for r in runs["four"]]
    assert sorted(r["coord"] for r in results) == [(0, d, m) for d in range(2) for m in range(2)]
    for r in results:
        _assert_equals_reference(r, reference, 2, f"ZeRO-{zero}, 2 × 2 uninterrupted, rank {r['coord']}")
    assert _mean_losses(results) == pytest.approx(reference["losses"][SAVE_AT:], rel=1e-5)
    meta = json.loads((Path(runs["dirs"][f"tp_zero{zero}"]) / TAG / "metadata.json").read_text())
    assert meta["zero_stage"] == zero and meta["model_parallel_size"] == 2 and meta["data_parallel_size"] == 2


@pytest.mark.parametrize("zero", [2, 3])
@pytest.mark.parametrize("layout", ["one", "two"], ids=["to-1-process", "to-2-model-x-1-data-zero2"])
def test_zero_tensor_parallel_checkpoint_loads_at_fewer_ranks(runs, reference, layout, zero):
    key = f"tp_zero{zero}"
    results = [_checked(runs["one"][key])] if layout == "one" else [_checked(r[key]) for r in runs["two"]]
    degree = 1 if layout == "one" else 2
    assert sorted(r["coord"] for r in results) == [(0, 0, m) for m in range(degree)]
    for r in results:
        _assert_equals_reference(r, reference, degree, f"ZeRO-{zero} 2 × 2 → {layout}, rank {r['coord']}")
        assert r["losses"] == pytest.approx(reference["losses"][SAVE_AT:], rel=1e-5)


@pytest.mark.parametrize("case", ["tp_zero3_at_zero2", "tp_zero2_at_zero3"])
def test_tensor_parallel_checkpoint_loads_at_another_zero_stage_on_the_same_grid(runs, reference, case):
    results = [_checked(r[case]) for r in runs["four"]]
    assert sorted(r["coord"] for r in results) == [(0, d, m) for d in range(2) for m in range(2)]
    for r in results:
        _assert_equals_reference(r, reference, 2, f"{case}, rank {r['coord']}")
    assert _mean_losses(results) == pytest.approx(reference["losses"][SAVE_AT:], rel=1e-5)


def test_megatron_layer_stages_checkpoint_loads_in_one_process(runs, pt_reference):
    """The stages built from engine.tensor_parallel's layers: saved at 2 pipe × 2 model, loaded into the
    same layer list in one process (the layers at degree 1 hold whole matrices)."""
    saved = [_checked(r["pipe_tp_layers"]) for r in runs["four"]]
    _assert_pt_equals_reference(saved, pt_reference, 2, "Megatron stages, 2 pipe × 2 model uninterrupted")
    result = _checked(runs["one"]["pipe_tp_layers"])
    assert result["coord"] == (0, 0, 0)
    _assert_pt_equals_reference([result], pt_reference, 1, "Megatron stages, 2 pipe × 2 model → 1 process")
