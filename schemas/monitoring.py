"""Monitoring sections: `tensorboard`, `csv_monitor`, `wandb`, `comet`, `comms_logger`,
`flops_profiler`, and dstrain's own `mfu`. Defaults are DeepSpeed 0.19.8's (`monitor/config.py`, `comm/config.py`,
`profiling/config.py`)."""
from __future__ import annotations

from typing import Optional

from pydantic import Field

from schemas.base import StrictModel


class TensorBoardConfig(StrictModel):
    """`tensorboard`: write training scalars as TensorBoard events."""

    enabled: bool = False
    """Log to TensorBoard (needs the `tensorboard` package)."""
    output_path: str = ""
    """Directory for event files; empty means under the launch directory."""
    job_name: str = "DeepSpeedJobName"
    """Sub-directory of output_path for this job."""


class CSVMonitorConfig(StrictModel):
    """`csv_monitor`: write training scalars to CSV files."""

    enabled: bool = False
    """Log to CSV files."""
    output_path: str = ""
    """Directory for CSV files; empty means under the launch directory."""
    job_name: str = "DeepSpeedJobName"
    """Sub-directory of output_path for this job."""


class WandbConfig(StrictModel):
    """`wandb`: log training scalars to Weights & Biases."""

    enabled: bool = False
    """Log to W&B (needs the `wandb` package)."""
    group: Optional[str] = None
    """W&B run group."""
    team: Optional[str] = None
    """W&B team (entity)."""
    project: str = "deepspeed"
    """W&B project."""


class CometConfig(StrictModel):
    """`comet`: log training scalars to Comet."""

    enabled: bool = False
    """Log to Comet (needs the `comet_ml` package)."""
    samples_log_interval: int = Field(100, ge=1)
    """Log every this many samples."""
    project: Optional[str] = None
    """Comet project name."""
    workspace: Optional[str] = None
    """Comet workspace."""
    api_key: Optional[str] = None
    """Comet API key (prefer the COMET_API_KEY environment variable)."""
    experiment_name: Optional[str] = None
    """Name of the Comet experiment."""
    experiment_key: Optional[str] = None
    """Key of an existing experiment to continue."""
    online: Optional[bool] = None
    """Log to the Comet server (true) or offline (false)."""
    mode: Optional[str] = None
    """"get", "create" or "get_or_create"."""


class CommsLoggerConfig(StrictModel):
    """`comms_logger`: per-collective timing and volume logging."""

    enabled: bool = False
    """Log collectives."""
    verbose: bool = False
    """Log every collective call as it happens."""
    prof_all: bool = True
    """Profile all collectives (otherwise only prof_ops)."""
    debug: bool = False
    """Include the calling function in each record."""
    prof_ops: list[str] = []
    """Collectives to profile when prof_all is false."""


class FlopsProfilerConfig(StrictModel):
    """`flops_profiler`: count FLOPs, parameters and latency per module at one step."""

    enabled: bool = False
    """Run the profiler (also turns on wall_clock_breakdown)."""
    recompute_fwd_factor: float = Field(0.0, ge=0.0)
    """Extra forward passes from activation recomputation, as a fraction."""
    profile_step: int = Field(1, ge=1)
    """Global step at which to profile."""
    module_depth: int = -1
    """Depth of the module tree to print; -1 all."""
    top_modules: int = Field(1, ge=1)
    """Modules listed in the aggregated profile."""
    detailed: bool = True
    """Print the detailed per-module profile."""
    output_file: Optional[str] = None
    """File for the profile; None prints to stdout."""


class MFUConfig(StrictModel):
    """`mfu` (dstrain's own key): the peak that model FLOPs utilisation is measured against."""

    peak_tflops: Optional[float] = Field(None, gt=0)
    """Peak TFLOPS of one device. None: a table of dense bf16 peaks for known GPUs
    (engine/profiling/peaks.py), or on a CPU an fp32 matmul measured once and cached."""
