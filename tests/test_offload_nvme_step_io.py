"""The bytes an NVMe optimizer step moves (offload/swapped_partition.py), counted per request of the I/O
engine: deterministic, unlike its time. What the step saves must change no bit of the result, so every
test here also compares with the in-memory optimizer over the whole flat, exactly.

- A flat's last sub-group is shorter than the pool buffer: its reads and writes move its own elements
  (rounded up to the O_DIRECT block), not the whole buffer.
- Kept sub-groups (swapped_partition.py's note): steps alternate their order, and the sub-groups the last
  step wrote are stepped from the pool's buffers without a read, as many as the pool holds (3 of 7 here),
  in every step after the first; bit for bit the in-memory optimizer over 5 steps, sequential and
  pipelined. A step that fails halfway after stepping kept buffers in place leaves the files and the
  training exact; a load into a stepped partition, and an edit of the master (`write_master`, also
  checked by test_offload_stepper's load_master test), are what the next step steps from.
"""
from __future__ import annotations

import pytest
import torch

from offload.aio import round_up
from tests.test_offload_stepper import OPTIMIZERS, Swapped, assert_state_equal, data, reference, steps_on_exactly


class Counted:
    """Wraps a Swapped's I/O engine: bytes asked for by reads and writes, per file name."""

    def __init__(self, swapped: Swapped):
        self.read = self.written = 0
        io = swapped.io
        read, write = io.read, io.write

        def counted_read(path, tensor, offset=0):
            self.read += tensor.numel() * tensor.element_size()
            return read(path, tensor, offset)

        def counted_write(path, tensor, offset=0):
            self.written += tensor.numel() * tensor.element_size()
            return write(path, tensor, offset)
        io.read, io.write = counted_read, counted_write

    def take(self) -> tuple[int, int]:
        out = (self.read, self.written)
        self.read = self.written = 0
        return out


def test_the_short_last_sub_group_moves_its_own_bytes_not_the_whole_buffer(tmp_path):
    numel, sub_group = 5000, 2048  # sub-groups of 2048, 2048 and 904 elements
    make = OPTIMIZERS["adamw-fused"]
    master, grads = data(steps=3, numel=numel)
    swapped = Swapped(tmp_path, make, numel, sub_group, pipeline=(True, True), buffers=9)
    try:
        swapped.part.initialize(lambda s, e: master[s:e])
        counted = Counted(swapped)
        tensors = 1 + len(swapped.part.state_keys)
        per_step = tensors * (2 * round_up(2048 * 4) + round_up(904 * 4))
        swapped.step(grads[0])  # the first step reads the master alone
        assert counted.take() == (per_step // tensors, per_step)
        for grad in grads[1:]:
            swapped.step(grad)
            assert counted.take()[1] == per_step
        want, _ = reference(make, master, grads)
        assert torch.equal(swapped.model, want)
    finally:
        swapped.close()


SUB_GROUP, GROUPS = 1024, 7


def _kept_run(tmp_path, pipeline, buffers=9, groups=GROUPS):
    make = OPTIMIZERS["adamw-fused"]
    swapped = Swapped(tmp_path, make, SUB_GROUP * groups, SUB_GROUP, pipeline=pipeline, buffers=buffers)
    return make, swapped


@pytest.mark.parametrize("pipeline", [(False, False), (True, True)], ids=["sequential", "pipelined"])
def test_steps_take_the_sub_groups_the_last_step_wrote_from_the_pool_bit_for_bit(tmp_path, pipeline):
    make, swapped = _kept_run(tmp_path, pipeline)
    master, grads = data(steps=5, numel=SUB_GROUP * GROUPS)
    want, want_state = reference(make, master, grads)
    try:
        swapped.part.initialize(lambda s, e: master[s:e])
        counted = Counted(swapped)
        tensor_bytes, tensors = SUB_GROUP * 4, 1 + len(swapped.part.state_keys)
        kept = swapped.pool.buffer_count // tensors  # 3 of the 7 sub-groups
        swapped.step(grads[0])
        assert counted.take() == (GROUPS * tensor_bytes, GROUPS * tensors * tensor_bytes)  # the master alone
        for step, grad in enumerate(grads[1:], start=1):
            swapped.step(grad)
            assert counted.take() == ((GROUPS - kept) * tensors * tensor_bytes, GROUPS * tensors * tensor_bytes), step
        assert swapped.part.sub_groups_kept == kept * (len(grads) - 1)
        assert torch.equal(swapped.model, want)
        assert_state_equal(swapped.part, want_state)  # the files: every write still made
    finally:
        swapped.close()


def test_a_step_failing_after_stepping_kept_buffers_leaves_the_files_and_training_exact(tmp_path):
    make, swapped = _kept_run(tmp_path, (True, True))
    master, grads = data(steps=5, numel=SUB_GROUP * GROUPS)
    want, want_state = reference(make, master, grads)  # the failed step never happened
    try:
        swapped.part.initialize(lambda s, e: master[s:e])
        for grad in grads[:2]:
            swapped.step(grad)
        assert swapped.part.step_order()[:3] == [0, 1, 2]  # ascending, after a descending step: the kept first
        live = {n: d for n, d in swapped.files_digest().items() if n.endswith(f".{swapped.part.source_slot}.swp")}

        def bad_grad(s, e):  # the kept sub-groups 0 and 1 are stepped in place before this fails
            if s >= 2 * SUB_GROUP:
                raise RuntimeError("gradient unavailable")
            return torch.full((e - s,), float("nan"))
        with pytest.raises(RuntimeError, match="gradient unavailable"):
            swapped.part.step(bad_grad)
        assert {n: d for n, d in swapped.files_digest().items() if n in live} == live
        steps_on_exactly(swapped, grads[2:], want, want_state)
    finally:
        swapped.close()


# 2 sub-groups in 12 buffers: the load's writes take the 6 untagged buffers and leave the kept ones be
@pytest.mark.parametrize("groups, buffers", [(GROUPS, 9), (2, 12)])
def test_a_load_into_a_stepped_partition_is_what_the_next_step_steps_from(tmp_path, groups, buffers):
    make, swapped = _kept_run(tmp_path, (True, True), buffers, groups)
    _, other = _kept_run(tmp_path, (True, True), buffers, groups)
    master, grads = data(steps=6, numel=SUB_GROUP * groups)
    want, want_state = reference(make, master, grads)
    try:
        other.part.initialize(lambda s, e: master[s:e])
        swapped.part.initialize(lambda s, e: torch.zeros(e - s))
        for grad in grads[:3]:
            other.step(grad)
            swapped.step(grad * 3)  # other weights, other moments, and kept buffers of them in the pool
        swapped.part.load_chunks(other.part.state_chunks())
        steps_on_exactly(swapped, grads[3:], want, want_state)
    finally:
        swapped.close()
        other.close()


def test_a_host_copy_of_the_master_is_read_instead_of_its_file_bit_for_bit(tmp_path):
    """`step(..., master_copy)` (swapped_partition.py's note: master copy) reads no master bytes from the
    files, writes every byte as before, and steps exactly as the in-memory optimizer."""
    make, swapped = _kept_run(tmp_path, (True, True))
    numel = SUB_GROUP * GROUPS
    master, grads = data(steps=4, numel=numel)
    want, want_state = reference(make, master, grads)
    try:
        swapped.part.initialize(lambda s, e: master[s:e])
        swapped.model.copy_(master)  # the engine's host flat: the committed master's exact copy
        counted = Counted(swapped)
        per_tensor = round_up(SUB_GROUP * 4)
        for i, grad in enumerate(grads):
            kept = swapped.part.sub_groups_kept
            swapped.part.step(lambda s, e, g=grad: g[s:e], lambda s, e, m: swapped.model[s:e].copy_(m),
                              lambda s, e: swapped.model[s:e])
            read_groups = GROUPS - (swapped.part.sub_groups_kept - kept)
            state_tensors = len(swapped.part.state_keys) if i else 0
            assert counted.take() == (read_groups * state_tensors * per_tensor,
                                      GROUPS * (1 + len(swapped.part.state_keys)) * per_tensor)
        assert torch.equal(swapped.model, want)
        assert torch.equal(swapped.part.read_master(0, numel), want)
        assert_state_equal(swapped.part, want_state)
    finally:
        swapped.close()


def _engine_master_reads(nvme_path: str, stage: int, precision: dict) -> dict:
    """4 AdamW steps at `stage` with the optimizer on NVMe, against no offload in the same precision: the
    bytes the tier read from its master files per step, and the parameters."""
    from engine.utils import safe_get_full_fp32_param
    from tests.models import OddMLP, make_batches, micro_batches
    import engine
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    out = {"master_read": []}
    for name in ("none", "nvme"):
        zero = {"stage": stage} if name == "none" else {
            "stage": stage, "sub_group_size": 64, "offload_optimizer": {
                "device": "nvme", "nvme_path": nvme_path, "buffer_count": 9, "pipeline_read": True,
                "pipeline_write": True}}
        torch.manual_seed(0)
        eng = engine.initialize(model=OddMLP(), config={
            "train_batch_size": 4 * world, "gradient_clipping": 1.0, "zero_optimization": zero, **precision,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.01}}})[0]
        if name == "nvme":
            io, read = eng.zero_optimizer.nvme.io, eng.zero_optimizer.nvme.io.read
            seen = [0]

            def counted(path, tensor, offset=0):
                if ".master." in path:
                    seen[0] += tensor.numel() * tensor.element_size()
                return read(path, tensor, offset)
            io.read = counted
        for x, y in make_batches(4, 4 * world):
            (xm, ym), = micro_batches(x, y, rank, world, 1)
            dtype = torch.bfloat16 if precision else torch.float32
            eng.backward(eng(xm.to(dtype), ym.to(dtype)))
            if name == "nvme":
                seen[0] = 0
            eng.step()
            if name == "nvme":
                out["master_read"].append(seen[0])
        out[name] = {n: safe_get_full_fp32_param(p) for n, p in eng.module.named_parameters() if p.requires_grad}
        eng.destroy()
    return out


@pytest.mark.parametrize("stage,precision", [(2, {}), (3, {}), (3, {"bf16": {"enabled": True}})],
                         ids=["stage2", "stage3", "stage3-bf16"])
def test_the_engine_steps_the_master_from_its_host_flat_equal_to_no_offload(tmp_path, stage, precision):
    """With the parameters on the host, stage 3's fp32 partition is the master's copy in bf16 training too."""
    from tests.harness import run_distributed
    for rank, result in enumerate(run_distributed(_engine_master_reads, 2, args=(str(tmp_path), stage, precision),
                                                  timeout=180)):
        assert result["master_read"] == [0, 0, 0, 0], f"rank {rank} read its master files: {result['master_read']}"
        for n, want in result["none"].items():
            assert torch.equal(result["nvme"][n], want), f"rank {rank} {n}"
