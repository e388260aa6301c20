"""Sections for features that sit beside the core loop: `aio`, `activation_checkpointing`,
`sparse_attention`, `pipeline`, `elasticity`.

Defaults are DeepSpeed 0.19.8's. DeepSpeed reads these sections as plain dicts and ignores unknown
keys; here they are strict like every other section (see `schemas/base.py`).
"""
from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import Field

from schemas.base import Size, StrictModel


class AioConfig(StrictModel):
    """`aio`: asynchronous file I/O used by NVMe offload."""

    block_size: Size = Field(1_048_576, ge=1)
    """Bytes per I/O request."""
    queue_depth: int = Field(8, ge=1)
    """I/O requests in flight per submission queue."""
    intra_op_parallelism: int = Field(1, ge=1)
    """Submission queues (formerly `thread_count`): with `queue_depth`, the requests in flight are their
    product (offload/aio.py runs that many worker threads, each one blocking syscall at a time)."""
    single_submit: bool = False
    """Submit requests one at a time instead of in batches."""
    overlap_events: bool = True
    """Overlap submitting new requests with waiting for completed ones."""
    use_gds: bool = False
    """Use NVIDIA GPUDirect Storage."""


class ActivationCheckpointingConfig(StrictModel):
    """`activation_checkpointing`: `initialize()` applies it (`engine.checkpointing.configure`), unlike
    DeepSpeed, which leaves that call to the user. See docs/activation_checkpointing.md."""

    partition_activations: bool = False
    """Keep 1/tp of each input saved by `engine.checkpointing.checkpoint` per tensor-parallel rank (the
    group of the `mpu` given to `configure`); all-gathered back in backward. No-op without one."""
    cpu_checkpointing: bool = False
    """Keep the inputs saved by checkpointed regions in host memory (pinned, asynchronous on an
    accelerator); with partition_activations, this rank's slice."""
    contiguous_memory_optimization: bool = False
    """Copy the partitioned inputs `checkpoint()` saves into one preallocated buffer per input position,
    `number_checkpoints` slots long (against fragmentation). Needs partition_activations."""
    number_checkpoints: Optional[int] = Field(None, ge=1)
    """Checkpoints in one forward: the slots of the contiguous buffer."""
    synchronize_checkpoint_boundary: bool = False
    """Synchronise the accelerator at each checkpoint's start and end (for profiling); no-op on CPU."""
    profile: bool = False
    """Time each checkpoint's forward and recompute (`engine.checkpointing.profile_summary()`)."""
    checkpoint_blocks: bool = False
    """dstrain: checkpoint every repeated block of the model (the children of each ModuleList or
    Sequential of two or more modules of one class) without editing it."""
    checkpoint_module_classes: list[str] = []
    """dstrain: also checkpoint every module whose class has one of these names."""
    policy: Literal["full", "selective", "selective_all_matmuls", "selective_unpack"] = "full"
    """dstrain: for the blocks above, "full" recomputes everything; "selective" keeps the outputs of
    matrix products (but not of those that widen 4x or more, an MLP's up projection), attention and
    collectives and recomputes the rest; "selective_all_matmuls" keeps every matrix product's output;
    "selective_unpack" runs the block once, drops the saved outputs of views, layer norms, GELU, copies
    and widening matrix products, and remakes each when backward unpacks it (no region re-run); the
    model's forward outside the blocks too (a GPT's final layer norm)."""


class SparseAttentionConfig(StrictModel):
    """`sparse_attention`: block-sparse attention layout for `ops.sparse_attention`."""

    mode: Literal["dense", "fixed", "variable", "bigbird", "bslongformer"] = "fixed"
    """Sparsity pattern family."""
    block: int = Field(16, ge=1)
    """Block size (tokens) of the block-sparse layout."""
    different_layout_per_head: bool = False
    """Give every attention head its own layout."""
    num_local_blocks: int = Field(4, ge=0)
    """fixed/variable/bigbird: blocks in each local window."""
    num_global_blocks: int = Field(1, ge=0)
    """fixed/bigbird: global blocks per window."""
    attention: Literal["bidirectional", "unidirectional"] = "bidirectional"
    """Whether tokens attend to later tokens (bidirectional) or only earlier ones."""
    horizontal_global_attention: bool = False
    """Global blocks also attend to all other blocks (bidirectional only)."""
    num_different_global_patterns: int = Field(1, ge=1)
    """fixed: distinct global patterns across heads."""
    num_random_blocks: int = Field(0, ge=0)
    """variable/bigbird: random blocks per row."""
    local_window_blocks: list[int] = [4]
    """variable: blocks in each successive local window."""
    global_block_indices: list[int] = [0]
    """variable/bslongformer: indices of global blocks."""
    global_block_end_indices: Optional[list[int]] = None
    """variable/bslongformer: end indices of global block ranges."""
    num_sliding_window_blocks: int = Field(3, ge=1)
    """bigbird/bslongformer: blocks in the sliding window."""


class PipelineConfig(StrictModel):
    """`pipeline`: pipeline-parallel options for `engine.pipe.PipelineModule`."""

    stages: Union[int, Literal["auto"]] = "auto"
    """Pipeline stages; "auto" takes them from the model (`PipelineModule(num_stages=)`); a number must
    equal the model's."""
    schedule: Literal["1f1b", "eager_1f1b", "zb_h1", "gpipe", "interleaved_1f1b", "zero_bubble"] = "1f1b"
    """dstrain's: the pipeline schedule (docs/parallelism.md). "interleaved_1f1b" and "zero_bubble" need
    `PipelineModule(virtual_stages=2)` or more; "eager_1f1b" (1F1B with each stage one micro-batch further
    ahead: no round trip per micro-batch, up to 2(p − s) − 1 micro-batches of activations on stage s)
    runs on gloo only; "zb_h1" (1F1B with each backward split into its input and weight gradients, the
    weight gradients deferred into the drain: a third of 1F1B's bubble) holds up to p micro-batches of
    activations on every stage."""
    partition: str = "best"
    """How layers are assigned to stages."""
    seed_layers: bool = False
    """Seed each layer's RNG from its index so stage assignment does not change init."""
    activation_checkpoint_interval: int = Field(0, ge=0)
    """Checkpoint every N layers' activations; 0 off."""
    pipe_partitioned: bool = True
    """Partition activations sent between stages across tensor-parallel ranks."""
    grad_partitioned: bool = True
    """Partition gradients sent between stages across tensor-parallel ranks."""


class ElasticityConfig(StrictModel):
    """`elasticity`: choose batch sizes that stay valid across a range of GPU counts."""

    enabled: bool = False
    """Compute the batch keys from the elastic settings below."""
    max_train_batch_size: int = Field(2000, ge=1)
    """Largest acceptable global batch size."""
    micro_batch_sizes: list[int] = [2, 4, 6]
    """Acceptable micro-batch sizes per GPU."""
    min_gpus: int = Field(1, ge=1)
    """Fewest GPUs the job may run on."""
    max_gpus: int = Field(10000, ge=1)
    """Most GPUs the job may run on."""
    min_time: int = Field(0, ge=0)
    """Minimum minutes between scaling events."""
    prefer_large_batch: bool = True
    """Prefer the largest valid batch size."""
    version: float = 0.2
    """Elasticity algorithm version."""
    ignore_non_elastic_batch_info: bool = False
    """Ignore batch keys given beside elasticity instead of failing."""
    num_gpus_per_node: int = Field(1, ge=1)
    """GPUs per node (version 0.2)."""
    model_parallel_size: int = Field(1, ge=1)
    """Model-parallel degree (version 0.2)."""


CONTIGUOUS_KEYS = tuple(f"activation_checkpointing.{key}" for key in (
    "partition_activations", "contiguous_memory_optimization", "number_checkpoints"))


def contiguous_checkpointing_problems(partition: bool, contiguous: bool, number: Optional[int],
                                      keys: tuple[str, ...] = CONTIGUOUS_KEYS) -> list[str]:
    """DeepSpeed's two `configure` assertions on contiguous checkpointing, as problem lines naming
    `keys` (the config's key paths, or `configure()`'s argument names)."""
    partition_key, contiguous_key, number_key = keys
    if not contiguous:
        return []
    problems = []
    if not partition:
        problems.append(f"{contiguous_key}: true needs {partition_key}: true (it lays out the partitioned "
                        f"activations); set {partition_key} to true or {contiguous_key} to false")
    if number is None:
        problems.append(f"{contiguous_key}: true needs {number_key} (the checkpoints in one forward, the "
                        f"slots of the buffer); set it to the model's number of checkpointed layers")
    return problems
