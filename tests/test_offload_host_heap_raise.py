"""A stage-3 forward that raises does not leave glibc's mmap threshold at the forward's value
(offload/host_heap.py's fourth note): the root's always-called forward hook puts the bound back, so what
the process does after the failed forward (an OOM's batch skipped, an engine destroyed) has its large
blocks mapped and returned on free again. A fresh interpreter: the thresholds are process-wide."""
from tests.test_offload_host_heap import MALLINFO, _probe, needs_glibc

RAISE_PROBE = MALLINFO + r"""
import engine
class Raising(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)
    def forward(self, x):
        raise RuntimeError("out of memory (a test's)")
with tempfile.TemporaryDirectory() as root:
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": root, "max_in_cpu": 0}}}
    eng = engine.initialize(model=Raising(), config=cfg)[0]
    try:
        eng(torch.ones(2, 64))
    except RuntimeError as e:
        assert "a test's" in str(e), e
    proc, got = psutil.Process(), {}

    def blocks_mapped_and_returned(after):
        rss0, mapped0 = proc.memory_info().rss, libc.mallinfo2().hblkhd
        blocks = [torch.ones(2 << 20) for _ in range(8)]
        mapped = libc.mallinfo2().hblkhd - mapped0
        del blocks
        got[after] = {"mapped_mib": mapped / 2**20, "kept_mib": (proc.memory_info().rss - rss0) / 2**20}
    blocks_mapped_and_returned("live")  # the engine still there, as after an OOM's batch skipped
    eng.destroy()
    blocks_mapped_and_returned("destroyed")
    print(json.dumps(got))
"""


@needs_glibc
def test_a_forward_that_raised_leaves_the_bound_in_place():
    """With the engine live after the failed forward, then once it is destroyed: one interpreter measures
    both (each measurement allocates and frees its own blocks)."""
    got = _probe({}, tier="-", script=RAISE_PROBE)
    for after in ("live", "destroyed"):
        assert got[after]["mapped_mib"] >= 56, (after, got)  # the eight 8 MiB blocks mapped (32 MiB: from the heap)
        assert got[after]["kept_mib"] < 8, (after, got)      # and handed back on free
