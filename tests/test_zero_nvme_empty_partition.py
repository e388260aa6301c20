"""The optimizer on NVMe (`offload_optimizer.device: "nvme"`) on a pipeline stage with no parameter of its own
(only Tanh): its partition has no flat at all. Before, `engine.initialize` failed on that stage with
`max() arg is an empty sequence` (nvme_tier.py sized its buffer pool from the largest flat). Now the stage's
tier steps nothing, and the stage still joins every step's status all-gather over the world (partitioned.py's
and stage3.py's notes: a step failed on some rank), so:

- it trains, and equals the same run without offload bit for bit (SGD with momentum, unclipped, fp32:
  every strategy is the math of the same step);
- a step failing on the other stage (rank 1's momentum writes past the first sub-group, the injection of
  tests/test_pipeline_nvme_step_failure.py) makes the parameter-free rank raise PeerStepError naming rank 1
  from the same `train_batch` instead of leaving rank 1 waiting, and training on equals a run that never
  saw the batch.

2 stages x 1 data rank: rank 0 is the parameter-free stage 0, rank 1 stage 1 (one Linear: three sub-groups)."""
from __future__ import annotations

import os

import pytest
import torch

from tests.harness import run_distributed
from tests.test_zero_stage3_step_failure import FAILING_RANK, _state_writes_fail

STEPS, FAILED, GAS, MICRO, WIDTH = 4, 1, 2, 2, 32


def _engine(path: str | None, stage: int):
    import engine
    from engine.pipe import LayerSpec, PipelineModule
    from tests.pipe_models import mse
    torch.manual_seed(0)
    specs = [torch.nn.Tanh(), torch.nn.Tanh(), LayerSpec(torch.nn.Linear, WIDTH, WIDTH), torch.nn.Tanh()]
    pm = PipelineModule(specs, num_stages=2, loss_fn=mse, seed_layers=True, partition_method="uniform")
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "gradient_clipping": 0.0,
              "zero_optimization": zero, "zero_allow_untested_optimizer": True, "pipeline": {"schedule": "1f1b"},
              "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}}
    if path:  # 512-element sub-groups: rank 1's 1056 elements step in three
        zero.update(sub_group_size=512, offload_optimizer={"device": "nvme", "nvme_path": path})
        config["aio"] = {"block_size": 4096}
    return engine.initialize(model=pm, config=config)[0], pm


def _run(tmp: str, stage: int) -> dict:
    """A run without offload and without batch FAILED, then the NVMe run where rank 1's step of batch
    FAILED fails."""
    from engine.utils import safe_get_full_fp32_param
    from tests.models import micro_batches
    g = torch.Generator().manual_seed(7)
    batches = [(torch.randn(MICRO * GAS, WIDTH, generator=g), torch.randn(MICRO * GAS, WIDTH, generator=g))
               for _ in range(STEPS)]
    out = {"errors": {}}
    for name in ("ref", "nvme"):
        path = os.path.join(tmp, str(torch.distributed.get_rank())) if name == "nvme" else None
        if path:
            os.makedirs(path, exist_ok=True)
        eng, pm = _engine(path, stage)
        losses = []
        for i in range(STEPS):
            if name == "ref" and i == FAILED:
                continue
            try:
                with _state_writes_fail(name == "nvme" and i == FAILED, 1, "momentum_buffer"):
                    losses.append(float(eng.train_batch(iter(list(micro_batches(*batches[i], 0, 1, GAS))))))
            except RuntimeError as err:
                out["errors"].setdefault(i, []).append((type(err).__name__, str(err)))
        out[name] = {"params": {n: safe_get_full_fp32_param(p) for n, p in pm.named_parameters()},
                     "counters": (eng.global_steps, eng.micro_steps, eng.skipped_steps), "losses": losses}
        eng.destroy()
    return out


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_parameter_free_stage_trains_on_nvme_and_hears_of_the_other_stages_failed_step(tmp_path, stage):
    ranks = run_distributed(_run, world_size=2, args=(str(tmp_path), stage), timeout=90)
    assert [len(out["nvme"]["params"]) for out in ranks] == [0, 2]  # stage 0 holds no parameter
    for rank, out in enumerate(ranks):
        (kind, msg), = out["errors"].pop(FAILED)
        assert not out["errors"], (rank, out["errors"])
        if rank == FAILING_RANK:  # its own error, naming the swap file
            assert kind == "OffloadIOError" and ".momentum_buffer." in msg, (rank, msg)
        else:
            assert kind == "PeerStepError" and f" rank {FAILING_RANK}'s optimizer step failed" in msg, (rank, msg)
        nvme, ref = out["nvme"], out["ref"]
        assert nvme["counters"] == ref["counters"], (rank, nvme["counters"], ref["counters"])
        assert nvme["losses"] == ref["losses"], (rank, nvme["losses"], ref["losses"])
        for name, w in ref["params"].items():
            assert torch.equal(nvme["params"][name], w), (rank, name, (nvme["params"][name] - w).abs().max())
