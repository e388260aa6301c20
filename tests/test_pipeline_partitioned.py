"""`pipeline.pipe_partitioned` / `pipeline.grad_partitioned` (engine/pipe/partitioned_wire.py): on 2 pipe ×
2 model ranks, examples/gpt_pipe.py's GPT trained with both keys true (each tensor rank sends its half of
every activation and gradient crossing the stage boundary) and with both false (whole tensors) equals
the dense model trained in one process (SGD unclipped, the reference and checks of
tests/test_pipeline_tensor_parallel.py: parameters, the loss on every rank and the reported norm), and the
bytes each rank's stage sends across the boundary, counted on torch's send ops, halve in each direction.
Both routes to the model axis: Megatron layers and AutoTP. Without a model axis (2 pipe × 2 data) the keys
change nothing on the wire. A mixed pair is refused with a message naming both keys. A boundary that cuts
a column/row-parallel pair carries each tensor rank's own shard: it is detected and crosses whole. One
spawn of 4."""
from __future__ import annotations

import pytest

from tests.harness import run_distributed
from tests.models import micro_batches
from tests.test_pipeline_tensor_parallel import GAS, LR, MICRO, _batches, _cfg, _check, _dense_name

STEPS = 3
ROUTES = ("layers", "autotp")


def _train(route: str, sliced: bool, steps: int, grads_sliced: bool | None = None) -> dict:
    """`sliced`: pipeline.pipe_partitioned, and grad_partitioned unless `grads_sliced` says otherwise."""
    import torch.distributed as dist

    import engine
    from engine.pipe import PipelineModule
    from engine.topology import Topology
    from examples.gpt_pipe import gpt_layers, gpt_loss
    topo = Topology.for_world(dist.get_world_size(), pipe=2, model=1 if route == "dense" else 2)
    pm = PipelineModule(gpt_layers(_cfg(), tensor_parallel=route == "layers"), topology=topo, loss_fn=gpt_loss,
                        seed_layers=True, partition_method="type:BlockLayer")
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
              "optimizer": {"type": "SGD", "params": {"lr": LR}}, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": 1}, "gradient_clipping": 0.0,
              "pipeline": {"pipe_partitioned": sliced,
                           "grad_partitioned": sliced if grads_sliced is None else grads_sliced}}
    if route == "autotp":
        config["tensor_parallel"] = {"autotp_size": 2}
    eng, *_ = engine.initialize(model=pm, config=config)
    dp, dp_rank = eng.comm.world_size, eng.comm.rank
    losses, norms = [], []
    for x, y in _batches(steps, dp):
        losses.append(float(eng.train_batch(iter(list(micro_batches(x, y, dp_rank, dp, GAS))))))
        norms.append(eng.get_global_grad_norm())
    params = {_dense_name(n): (p.detach().clone(), getattr(p, "tensor_parallel_dim", None),
                               getattr(p, "tensor_parallel_parts", 1)) for n, p in pm.named_parameters()}
    result = {"coord": tuple(pm.process_groups.coord), "params": params, "losses": losses, "norms": norms,
              "skipped": eng.skipped_steps, "sharded": sum(d is not None for _, d, _ in params.values()),
              "sent": eng.boundary_bytes(),
              "early": sum(st.early.count for entry in eng._built.values() for st in entry[0])}
    eng.destroy()
    return result


def _sharded_specs(tensor_parallel: bool) -> list:
    """Uniformly partitioned, the stage boundary falls between the column- and the row-parallel layer."""
    import torch.nn as nn

    from engine.pipe import LayerSpec
    from tests.pipe_models import D
    if not tensor_parallel:
        return [LayerSpec(nn.Linear, D, D), LayerSpec(nn.Linear, D, 4 * D), nn.Tanh(),
                LayerSpec(nn.Linear, 4 * D, D), LayerSpec(nn.Linear, D, D)]
    from engine.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    return [LayerSpec(nn.Linear, D, D), LayerSpec(ColumnParallelLinear, D, 4 * D, gather_output=False), nn.Tanh(),
            LayerSpec(RowParallelLinear, 4 * D, D, input_is_parallel=True), LayerSpec(nn.Linear, D, D)]


def _train_sharded_boundary(sliced: bool) -> dict:
    import torch.distributed as dist

    import engine
    from engine.pipe import PipelineModule
    from engine.topology import Topology
    from tests.pipe_models import global_batches, mse
    topo = Topology.for_world(dist.get_world_size(), pipe=2, model=2)
    pm = PipelineModule(_sharded_specs(True), topology=topo, loss_fn=mse, seed_layers=True, partition_method="uniform")
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
              "optimizer": {"type": "SGD", "params": {"lr": LR}}, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": 1}, "gradient_clipping": 0.0,
              "pipeline": {"pipe_partitioned": sliced, "grad_partitioned": sliced}}
    eng, *_ = engine.initialize(model=pm, config=config)
    losses, norms = [], []
    for x, y in global_batches(STEPS, MICRO * GAS, False):
        losses.append(float(eng.train_batch(iter(list(micro_batches(x, y, 0, 1, GAS))))))
        norms.append(eng.get_global_grad_norm())
    result = {"coord": tuple(pm.process_groups.coord), "parts": pm.parts, "losses": losses, "norms": norms,
              "params": {n: p.detach().clone() for n, p in pm.named_parameters()}, "sent": eng.boundary_bytes()}
    eng.destroy()
    return result


def _four_ranks():
    out = {(route, sliced): _train(route, sliced, STEPS) for route in ROUTES for sliced in (True, False)}
    out.update({("sharded", sliced): _train_sharded_boundary(sliced) for sliced in (True, False)})
    out.update({("dense", sliced): _train("dense", sliced, 1) for sliced in (True, False)})
    out.update({("mixed", acts): _train("layers", acts, STEPS, grads_sliced=not acts) for acts in (True, False)})
    return out


@pytest.fixture(scope="module")
def four_ranks():
    return run_distributed(_four_ranks, world_size=4, timeout=300)


@pytest.mark.parametrize("sliced", [True, False], ids=["partitioned", "whole"])
@pytest.mark.parametrize("route", ROUTES)
def test_pipe2_x_tp2_equals_the_dense_model_either_way(four_ranks, route, sliced):
    _check([r[(route, sliced)] for r in four_ranks], STEPS, dp=1)


@pytest.mark.parametrize("route", ROUTES)
def test_slices_give_bit_for_bit_the_result_of_whole_tensors(four_ranks, route):
    import torch
    for r in four_ranks:
        sliced, whole = r[(route, True)], r[(route, False)]
        assert sliced["losses"] == whole["losses"] and sliced["norms"] == whole["norms"], sliced["coord"]
        for name, (p, _, _) in sliced["params"].items():
            assert torch.equal(p, whole["params"][name][0]), (sliced["coord"], name)
        # with slices too, each step's second receive in each direction was posted early (early_receive.py)
        assert sliced["early"] == whole["early"] == STEPS * (GAS - 1), (sliced["coord"], sliced["early"])


@pytest.mark.parametrize("route", ROUTES)
def test_partitioned_boundaries_send_a_tensor_parallel_share_of_the_bytes(four_ranks, route):
    for r in four_ranks:
        sliced, whole = r[(route, True)]["sent"], r[(route, False)]["sent"]
        pipe = r[(route, True)]["coord"][0]
        sends = "forward" if pipe == 0 else "backward"  # stage 0 sends activations, stage 1 gradients
        assert whole[sends] > 0, r[(route, True)]["coord"]
        assert sliced[sends] * 2 == whole[sends], (r[(route, True)]["coord"], sliced, whole)
        assert sliced == {**whole, sends: whole[sends] // 2}  # nothing else crossed


def test_without_a_model_axis_the_keys_change_nothing(four_ranks):
    for r in four_ranks:
        assert r[("dense", True)]["sent"] == r[("dense", False)]["sent"]
        assert r[("dense", True)]["losses"] == r[("dense", False)]["losses"]


@pytest.mark.parametrize("acts", [True, False], ids=["activations-sliced", "gradients-sliced"])
def test_a_mixed_pair_is_bit_for_bit_both_false_and_halves_its_own_direction(four_ranks, acts):
    import torch
    for r in four_ranks:
        mixed, whole = r[("mixed", acts)], r[("layers", False)]
        assert mixed["losses"] == whole["losses"] and mixed["norms"] == whole["norms"], mixed["coord"]
        for name, (p, _, _) in mixed["params"].items():
            assert torch.equal(p, whole["params"][name][0]), (mixed["coord"], name)
        sliced = "forward" if acts else "backward"  # stage 0 sends activations, stage 1 gradients
        assert sum(whole["sent"].values()) > 0, mixed["coord"]
        assert mixed["sent"] == {d: n // 2 if d == sliced else n for d, n in whole["sent"].items()}, mixed["coord"]


def test_a_boundary_carrying_a_tensor_parallel_shard_crosses_whole(four_ranks):
    """partitioned_wire.py's note "a boundary that is not replicated": with the keys true the sharded
    activation is detected and sent whole both ways, so training equals the dense model and both false."""
    import torch

    from tests.pipe_models import global_batches, mse, reference_params, reference_sgd
    norms = []
    ref, ref_losses = reference_sgd(_sharded_specs(False), global_batches(STEPS, MICRO * GAS, False), mse, LR, STEPS,
                                    norms=norms)
    want = reference_params(ref)
    for r in four_ranks:
        sliced, whole = r[("sharded", True)], r[("sharded", False)]
        assert sliced["parts"] == [0, 3, 5]  # the cut between ColumnParallelLinear and RowParallelLinear
        assert sliced["losses"] == pytest.approx(ref_losses, rel=1e-5), sliced["coord"]
        assert sliced["norms"] == pytest.approx(norms, rel=1e-5), sliced["coord"]
        for name in ("0.weight", "4.weight"):  # replicated layers: the dense model's
            if name in sliced["params"]:
                torch.testing.assert_close(sliced["params"][name], want[name], rtol=1e-5, atol=1e-6)
        assert sliced["losses"] == whole["losses"] and sliced["sent"] == whole["sent"], sliced["coord"]
        for name, p in sliced["params"].items():
            assert torch.equal(p, whole["params"][name]), (sliced["coord"], name)
