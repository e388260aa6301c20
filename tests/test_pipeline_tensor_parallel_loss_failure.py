"""A loss_fn with tensor-parallel collectives of its own (vocab_parallel_cross_entropy over the model
group) that raises on ONE tensor rank of the last stage before them (engine/tensor_parallel/
collective_ledger.py): the failing rank posts them for its tensor peer from the loss's record, so every
rank raises at once. Before, the loss was outside any record: the peer waited in the cross-entropy's
all-reduce until DSTRAIN_TIMEOUT (30 s here; the harness's 70 s fails the test). Raised in the first
schedule, before any record of the loss, the loss runs guarded (the ledger's note) and the next batch
trains."""
from __future__ import annotations

import time

import pytest
import torch

from tests.harness import run_distributed

ARMED = {"on": False}


class BadLabel(ValueError):
    pass


def _run(failing: int) -> dict:
    import torch.distributed as dist

    import engine
    from engine.pipe import PipelineModule
    from engine.tensor_parallel import vocab_parallel_cross_entropy
    from engine.topology import Topology
    from examples.gpt import GPTConfig
    from examples.gpt_pipe import gpt_layers
    topo = Topology.for_world(4, pipe=2, model=2)
    holder: dict = {}

    def loss_fn(logits, targets):  # this rank's half of the vocabulary, the loss over both halves
        tensor_rank = holder["pm"].process_groups.coord.model
        if ARMED["on"] and tensor_rank == 1:
            raise BadLabel("a bad label on tensor rank 1")
        local = logits.float().chunk(2, dim=-1)[tensor_rank]
        return vocab_parallel_cross_entropy(local, targets, group=holder["pm"].process_groups.model_group)
    pm = PipelineModule(gpt_layers(GPTConfig(vocab_size=32, seq_len=8, n_layer=2, n_head=4, d_model=16),
                                   tensor_parallel=True),
                        topology=topo, loss_fn=loss_fn, seed_layers=True, partition_method="type:ParallelBlockLayer")
    holder["pm"] = pm
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 0.0,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    eng, *_ = engine.initialize(model=pm, config=config)
    outcomes = []
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randint(0, 32, (4, 8), generator=g), torch.randint(0, 32, (4, 8), generator=g)
        ARMED["on"] = step == failing
        start = time.monotonic()
        try:
            eng.train_batch(data_iter=iter([(x[:2], y[:2]), (x[2:], y[2:])]))
            outcomes.append(None)
        except Exception as err:  # noqa: BLE001 - the outcome is what the test reads
            outcomes.append((type(err).__name__, str(err), time.monotonic() - start))
    eng.destroy()
    return {"rank": dist.get_rank(), "outcomes": outcomes}


@pytest.mark.parametrize("failing", [1, 0], ids=["recorded", "first-schedule"])
def test_a_loss_raising_on_one_tensor_rank_before_its_collectives_stops_every_rank_at_once(failing):
    results = run_distributed(_run, 4, args=(failing,), timeout=70, env={"DSTRAIN_TIMEOUT": "30"})
    for r in results:
        assert r["outcomes"][1 - failing] is None, r
        name, text, seconds = r["outcomes"][failing]
        assert seconds < 20, r
        if r["rank"] == 3:  # stage 1, tensor rank 1
            assert name == "BadLabel", r
        else:
            assert name == "StageFailed" and "tensor rank 1" in text and "a bad label" in text, r


if __name__ == "__main__":
    test_a_loss_raising_on_one_tensor_rank_before_its_collectives_stops_every_rank_at_once(0)
