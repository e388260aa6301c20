"""`Config`: the whole config, typed and frozen. Build it with `schemas.load_config`.

Attribute names are DeepSpeed's key names. The three batch keys are resolved ints (see
`schemas/batch.py`); `world_size` is the data-parallel world size that resolution used.
"""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, PrivateAttr

from schemas.base import StrictModel
from schemas.checkpoint import CheckpointConfig
from schemas.compression import GradientCompressionConfig
from schemas.fault_tolerance import FaultToleranceConfig
from schemas.features import (
    ActivationCheckpointingConfig,
    AioConfig,
    ElasticityConfig,
    PipelineConfig,
    SparseAttentionConfig,
)
from schemas.monitoring import (
    CometConfig,
    CommsLoggerConfig,
    CSVMonitorConfig,
    FlopsProfilerConfig,
    MFUConfig,
    TensorBoardConfig,
    WandbConfig,
)
from schemas.optimizer import OptimizerConfig
from schemas.precision import AmpConfig, BF16Config, DataTypesConfig, FP16Config
from schemas.scheduler import SchedulerConfig
from schemas.tensor_parallel import TensorParallelConfig
from schemas.zero import ZeroConfig

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


class Config(StrictModel):
    """A validated dstrain/DeepSpeed config."""

    train_batch_size: int = Field(ge=1)
    """Global batch: micro-batch × gradient_accumulation_steps × data-parallel world size."""
    train_micro_batch_size_per_gpu: int = Field(ge=1)
    """Samples per rank per forward/backward."""
    gradient_accumulation_steps: int = Field(ge=1)
    """Micro-batches accumulated before each optimizer step."""
    gradient_clipping: float = Field(1.0, ge=0.0)
    """Clip gradients to this global L2 norm; 0 turns clipping off (DeepSpeed 0.19.8 default 1.0)."""
    steps_per_print: Optional[int] = Field(None, ge=1)
    """Log progress every this many optimizer steps; None never."""
    wall_clock_breakdown: bool = False
    """Time forward, backward, all-reduce and step, and log the times."""
    dump_state: bool = False
    """Log the resolved config (JSON) on rank 0 when initialize has built the engine."""
    memory_breakdown: bool = False
    """Log memory use at each logging step (not built yet: true rejected)."""
    prescale_gradients: bool = False
    """Divide gradients by the world size before the all-reduce instead of after."""
    gradient_predivide_factor: float = Field(1.0, gt=0.0)
    """Divide gradients by this before the all-reduce and by world_size/factor after it."""
    communication_data_type: Optional[Literal["fp16", "bf16", "fp32"]] = None
    """Dtype of gradient all-reduce; None means the model's training dtype."""
    sparse_gradients: bool = False
    """All-reduce embedding gradients as sparse tensors (not built yet: true rejected)."""
    zero_allow_untested_optimizer: bool = False
    """Allow ZeRO with an optimizer outside the tested list."""
    zero_force_ds_cpu_optimizer: bool = True
    """DeepSpeed: with optimizer offload, require its CPU Adam op. dstrain steps offloaded state with the
    configured torch optimizer (fused CPU kernel for Adam/AdamW), so only the default is accepted."""
    disable_allgather: bool = False
    """Use broadcasts instead of all-gather for ZeRO parameter gathering (not built yet: true rejected)."""
    dataloader_drop_last: bool = False
    """Drop the last incomplete batch of the data loader built from training_data."""
    seed: int = Field(1234, ge=0)
    """Seeds torch's, Python's `random` and NumPy's global RNGs on every rank with seed + rank, and the
    data sampler's shuffle with seed (the same on all ranks)."""
    amp: AmpConfig = AmpConfig()
    """Apex AMP (not supported; use fp16 or bf16)."""
    optimizer: Optional[OptimizerConfig] = None
    """Optimizer built by initialize when no optimizer is passed in."""
    scheduler: Optional[SchedulerConfig] = None
    """LR schedule built by initialize when no lr_scheduler is passed in."""
    fp16: FP16Config = FP16Config()
    """fp16 mixed precision and loss scaling."""
    bf16: BF16Config = Field(BF16Config(), alias="bfloat16")
    """bf16 mixed precision (the key may also be written `bfloat16`)."""
    data_types: DataTypesConfig = DataTypesConfig()
    """Dtypes of intermediate buffers."""
    zero_optimization: ZeroConfig = ZeroConfig()
    """ZeRO stage and its buckets, offload and stage-3 options."""
    aio: AioConfig = AioConfig()
    """Asynchronous I/O for NVMe offload."""
    activation_checkpointing: ActivationCheckpointingConfig = ActivationCheckpointingConfig()
    """Activation checkpointing options."""
    sparse_attention: Optional[SparseAttentionConfig] = None
    """Block-sparse attention layout; None when the section is absent."""
    checkpoint: CheckpointConfig = CheckpointConfig()
    """Checkpoint validation, periodic saving and auto-resume."""
    pipeline: PipelineConfig = PipelineConfig()
    """Pipeline parallelism."""
    tensor_parallel: TensorParallelConfig = TensorParallelConfig()
    """Tensor parallelism (AutoTP): `autotp_size`."""
    tensorboard: TensorBoardConfig = TensorBoardConfig()
    """TensorBoard monitor."""
    csv_monitor: CSVMonitorConfig = CSVMonitorConfig()
    """CSV monitor."""
    wandb: WandbConfig = WandbConfig()
    """Weights & Biases monitor."""
    comet: CometConfig = CometConfig()
    """Comet monitor."""
    comms_logger: CommsLoggerConfig = CommsLoggerConfig()
    """Collective-communication logger."""
    flops_profiler: FlopsProfilerConfig = FlopsProfilerConfig()
    """FLOPs profiler."""
    mfu: MFUConfig = MFUConfig()
    """dstrain: the peak for MFU/HFU in the log line and the monitors."""
    elasticity: ElasticityConfig = ElasticityConfig()
    """Elastic batch sizes."""
    fault_tolerance: FaultToleranceConfig = FaultToleranceConfig()
    """dstrain: NaN/Inf policy."""
    gradient_compression: Optional[GradientCompressionConfig] = None
    """dstrain: compressed gradient all-reduce; None (absent) means uncompressed."""

    _world_size: int = PrivateAttr(1)
    _given_batch: dict = PrivateAttr(default_factory=dict)

    @property
    def world_size(self) -> int:
        """The data-parallel world size the batch arithmetic used."""
        return self._world_size

    @property
    def given_batch_keys(self) -> dict:
        """The batch keys as the user gave them (before derivation), for re-resolving."""
        return dict(self._given_batch)

    def to_dict(self) -> dict:
        """The resolved config as JSON-ready data (DeepSpeed key names; re-loadable)."""
        return self.model_dump(mode="json", exclude_none=False)
