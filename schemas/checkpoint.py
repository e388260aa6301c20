"""`checkpoint`: DeepSpeed's checkpoint keys plus dstrain's periodic-save and resume keys."""
from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field, field_validator

from schemas.base import StrictModel


class ParallelWriteConfig(StrictModel):
    """`checkpoint.parallel_write`: spread checkpoint writes across ranks."""

    pipeline_stage: bool = False
    """Each pipeline stage writes its own layers."""


class CheckpointConfig(StrictModel):
    """`checkpoint`: how checkpoints are validated, written and resumed."""

    tag_validation: Literal["Ignore", "Warn", "Fail"] = "Warn"
    """What to do when ranks disagree on a checkpoint tag (case-insensitive, as in DeepSpeed)."""
    load_universal: bool = False
    """Load a DeepSpeed universal checkpoint (not built yet: true rejected; dstrain's own checkpoints
    load at any world size and stage without it)."""
    use_node_local_storage: bool = False
    """Every node writes to its own local storage instead of a shared file system."""
    parallel_write: ParallelWriteConfig = ParallelWriteConfig()
    """Parallel checkpoint writing options."""
    save_dir: Optional[str] = None
    """dstrain: directory the engine saves periodic checkpoints to and auto-resumes from."""
    save_interval: int = Field(0, ge=0)
    """dstrain: save a checkpoint every this many optimizer steps; 0 turns periodic saving off."""
    keep_last: Optional[int] = Field(None, ge=1)
    """dstrain: keep only the newest N checkpoint tags in save_dir; None keeps all."""
    auto_resume: bool = False
    """dstrain: at initialize, load the `latest` checkpoint in save_dir if there is one."""
    async_save: bool = False
    """dstrain: write checkpoint files in a background thread so training continues."""

    @field_validator("tag_validation", mode="before")
    @classmethod
    def _capitalize(cls, value: Any) -> Any:
        return value.capitalize() if isinstance(value, str) else value
