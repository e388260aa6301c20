"""What the GPU script's checks share (benchmarks/gpu/run.py, offload_checks.py): the tiny GPT, its
config at a ZeRO stage and precision, its batches, and a training loop that records the host syncs of
every step but the first on a GPU."""
from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

import torch

from examples.gpt import GPTConfig, RandomTokens

ROOT = Path(__file__).resolve().parents[2]
TINY = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32)
PRECISIONS = {"fp32": {}, "bf16": {"bf16": {"enabled": True}}, "fp16": {"fp16": {"enabled": True}}}
MICRO, STEPS = 2, 4


def check_config(stage: int, precision: str, extra: dict | None = None) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": 2000}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=40, stage3_prefetch_bucket_size=3000,
                    stage3_gather_16bit_weights_on_model_save=True)
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": zero, "steps_per_print": 10**9,
           **PRECISIONS[precision]}
    cfg.update(extra or {})
    return cfg


def batches(n: int, cfg: GPTConfig, micro: int, rank: int = 0):
    data = RandomTokens(n * micro, cfg.seq_len, cfg.vocab_size, seed=rank)
    return [data[i * micro:(i + 1) * micro] for i in range(n)]


def train(eng, batches, count_syncs: bool = False) -> tuple[list[float], list[str]]:
    """Losses (read once, at the end) and the host syncs of every step but the first (GPU only)."""
    losses, syncs, dev = [], [], eng.device
    for i, (x, y) in enumerate(batches):
        x, y = x.to(dev), y.to(dev)
        watch = count_syncs and i > 0 and dev.type == "cuda"
        with sync_watch(syncs) if watch else contextlib.nullcontext():
            loss = eng(x, y)
            eng.backward(loss)
            eng.step()
        losses.append(loss.detach())
    return [float(v) for v in losses], syncs


@contextlib.contextmanager
def sync_watch(out: list[str]):
    """Record where the host waited for the GPU (torch's sync debug mode warns at each such op)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for w in caught:  # a warning from C++ carries the innermost Python caller's file and line
        if "synchroniz" in str(w.message):
            path = Path(w.filename)
            out.append(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name}:{w.lineno}")
