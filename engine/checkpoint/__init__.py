"""Checkpoints: sharded, atomic, reshardable (DESIGN.md decision 4; docs/checkpoints.md).

`Checkpointing` (api.py) is what `Engine.save_checkpoint` / `load_checkpoint` delegate to. The parts:
`format.py` the layout, metadata and checksums; `state.py` per-ZeRO-stage adapters between an
optimizer's storage and per-parameter fragments; `snapshot.py` collecting a rank's share; `writer.py`
the atomic commit and async saving; `reader.py` verification and row assembly (resharding);
`restore.py` loading into an engine; `consolidate.py` the `dstrain ckpt` tools.
"""
from .api import Checkpointing
from .format import CheckpointError

__all__ = ["Checkpointing", "CheckpointError"]
