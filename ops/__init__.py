"""Numerical building blocks with no engine state (they import torch only).

Communication compression (docs/compression.md):
- `onebit`: sign packing 8 per byte, the 1-bit compressor, and `CompressedAllReduce`, the
  error-compensated two-phase all-reduce (all-to-all + all-gather) of 1-bit Adam.
- `OneBitAdam`, `ZeroOneAdam`, `OneBitLamb`: torch optimizers that, after warm-up, average their
  momentum themselves through a communicator (`CompressedOptimizer` is their shared base and the
  protocol the engine uses to switch its own gradient all-reduce off).
- `Lamb`: LAMB with DeepSpeed's coefficient clipping, per tensor also over flat partitions (`tensor_segments`).
- `Adagrad`: torch's Adagrad with its state made at the first step (ZeRO-ready).
- `Lion`: Lion, elementwise, foreach. `MuonWithAuxAdam`: Muon for hidden matrices, AdamW for the rest.
- `UncorrectedAdam`: Adam/AdamW without bias correction (DeepSpeed's `bias_correction: false`).
- `PowerSGD`: low-rank gradient averaging with error feedback, a bucket reducer for data parallelism.
- `state_layout`: each optimizer class's declared state kinds (per element, scalar, per tensor).
Collectives go through any object shaped like `engine.comm.Communicator` (world_size, all_reduce,
all_to_all, all_gather), so the bytes they move are counted.
"""
from .compressed_optimizer import CompressedOptimizer
from .adagrad import Adagrad
from .adam import UncorrectedAdam
from .lamb import Lamb
from .lion import Lion
from .muon import MuonWithAuxAdam
from .onebit import CompressedAllReduce, pack_signs, unpack_signs
from .onebit_adam import OneBitAdam
from .onebit_lamb import OneBitLamb
from .powersgd import PowerSGD
from .zero_one_adam import ZeroOneAdam

__all__ = ["Adagrad", "CompressedAllReduce", "CompressedOptimizer", "Lamb", "Lion", "MuonWithAuxAdam", "OneBitAdam", "OneBitLamb", "PowerSGD",
           "UncorrectedAdam", "ZeroOneAdam", "pack_signs", "unpack_signs"]
