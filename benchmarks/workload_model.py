"""The GPT that bench_training.py's systems train, chosen once for dstrain's ranks and DeepSpeed's peer.

`bench_training.py --model demo` exports DSTRAIN_BENCH_MODEL=demo; its ranks and the DeepSpeed peer it
starts (benchmarks/deepspeed_peer.py, in DeepSpeed's own venv: this module imports only the standard
library and examples/gpt.py) read it here, so both systems build the same model. An unknown value is
an error, never the 25M default in silence.
"""
from __future__ import annotations

import os

from examples.gpt import BENCH_CONFIG as BENCH_25M
from examples.gpt import GPTConfig

ENV = "DSTRAIN_BENCH_MODEL"
# --model demo: the demo's small GPT (examples/train_gpt.py defaults), e.g. for precision step times.
DEMO_CONFIG = GPTConfig(vocab_size=256, seq_len=64, n_layer=2, n_head=4, d_model=128)
MODELS = {"25m": BENCH_25M, "demo": DEMO_CONFIG}


def bench_config() -> GPTConfig:
    """The model DSTRAIN_BENCH_MODEL names ("25m" when unset)."""
    name = os.environ.get(ENV, "25m")
    if name not in MODELS:
        raise SystemExit(f"{ENV}={name!r}: unknown benchmark model; use one of {sorted(MODELS)}")
    return MODELS[name]
