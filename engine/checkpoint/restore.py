"""Loading a verified checkpoint into a live engine at any world size and ZeRO stage.

Weights first (every tensor the module holds, rebuilt from the fp32 rows; reader.py's note), then the
rows of master weights and optimizer state this rank's adapter holds, then the engine state (loss
scaler, optimizer hyperparameters, LR schedule, counters, sampler position) and this rank's RNG.
[Note: exactness] Nothing is recomputed: fp32 rows are copied bit for bit, model weights are the same
cast of them that a training step makes, and optimizer state tensors are copied into freshly zeroed
buffers (padding stays zero). At the same world size and stage, a resumed run is therefore bitwise the
run that never stopped; at another one only the summation order of reductions differs.
"""
from __future__ import annotations

import warnings

import torch

from ..precision import precision_name
from ..tensor_parallel.layers import is_partitioned
from . import format as fmt
from . import tensor_shards
from .placement import coordinates, global_rank_and_world, model_degree, stage_union
from .reader import FragmentSource, load_torch, verify
from .snapshot import module_entries
from .rank_state import load_rank_state
from .resume_checks import check_optimizer, warn_if_mid_window_load
from .state import adapter_for, set_rng_state


def _check_names(src: FragmentSource, current: set[str], strict: bool, whole: set[str] | None = None) -> None:
    """`current`: this rank's names; `whole`: the whole model's (every pipeline stage's; placement.py)."""
    missing = sorted(current - set(src.params))
    unexpected = sorted(set(src.params) - (current if whole is None else whole))
    if strict and (missing or unexpected):
        raise fmt.CheckpointError(
            f"{src.path}: the checkpoint does not match the model (load_module_strict=True): "
            f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''}, "
            f"unexpected {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")


def _check_shape(src: FragmentSource, name: str, shape) -> None:
    saved = list(src.params[name]["shape"])
    if saved != list(shape):
        raise fmt.CheckpointError(f"{src.path}: {name} has shape {saved} in the checkpoint, {list(shape)} "
                                  "in the model")


def _row_reader(src: FragmentSource, name: str, kind: str, start: int, stop: int):
    """Rows [start + r0, start + r1) on demand, for an adapter that reads a fragment piecewise."""
    return lambda r0, r1: src.rows(name, kind, start + r0, min(start + r1, stop))


def _rows_now(src, name: str, kind: str, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) read at once, through `src`'s own method: a tensor-parallel rank's source is a
    `LocalShards` that cuts its shard first (an unbound `FragmentSource.rows` skipped that)."""
    return src.rows(name, kind, start, stop)


@torch.no_grad()
def _load_trainable(src: FragmentSource, adapter, names: dict, load_state: bool) -> None:
    adapter.begin_load(load_state)
    for p in adapter.params():
        name = names[id(p)]
        if name not in src.params:
            continue
        shape = tensor_shards.expected_shape(p, src.params[name]) if is_partitioned(p) else adapter.shape(p)
        _check_shape(src, name, shape)
        weights = src.weights_kind(name)
        start, stop = adapter.load_rows(p)
        if adapter.holds_module_weights:  # the model's cast of the fp32 rows (module note)
            src.copy_rows(name, weights, p)
        # stage 3: p is a placeholder; the adapter refreshes what the stage keeps in finish_load
        rows = _row_reader if getattr(adapter, "streams_rows", False) else _rows_now  # nvme.py's note
        tensors = {fmt.FP32: rows(src, name, weights, start, stop)}
        if load_state:
            for kind, cls in src.kinds(name).items():
                if kind not in (fmt.FP32, fmt.MODULE):
                    tensors[kind] = rows(src, name, kind, start, stop) if cls == "rows" else src.scalar(name, kind)
        adapter.write(p, tensors, load_state)
    adapter.finish_load()


@torch.no_grad()
def _load_module_entries(src: FragmentSource, entries: dict, adapter) -> None:
    """Buffers and frozen parameters; a frozen tensor-parallel shard is cut from the full tensor by
    `src`, a `LocalShards` (tensor_shards.py)."""
    for key, t in entries.items():
        if key not in src.params:
            continue
        if is_partitioned(t):
            _check_shape(src, key, tensor_shards.expected_shape(t, src.params[key]))
            src.copy_rows(key, src.weights_kind(key), t)
            continue
        _check_shape(src, key, adapter.shape(t) if adapter else t.shape)
        held = adapter.entry_rows(t) if adapter else None
        if held is None:
            t.copy_(src.full(key, src.weights_kind(key)).reshape(t.shape))
        else:  # a chunk the stage keeps for a partitioned frozen parameter (stage 3)
            start, stop, rows = held
            rows.copy_(src.rows(key, src.weights_kind(key), start, stop).reshape(rows.shape))
            adapter.entry_rows_loaded(t, rows)  # a chunk read from a file goes back to it


def _sampler_state(saved: dict, world: int, micro: int) -> dict:
    """The sampler position at another world size: the same number of samples consumed, rounded down."""
    if saved["world_size"] == world and saved["micro_batch"] == micro:
        return saved
    samples = saved["batches_in_epoch"] * saved["micro_batch"] * saved["world_size"]
    return {"epoch": saved["epoch"], "batches_in_epoch": samples // (micro * world)}


def _restore_param_groups(eng, saved: list) -> None:
    """The saved hyperparameters (lr, betas, weight decay, ...) of each param group. With another number
    of groups there is no telling which saved group is which: the new config's values stay, and rank 0
    says so (DeepSpeed keeps them silently)."""
    groups = eng.optimizer.param_groups
    if len(saved) == len(groups):
        for group, values in zip(groups, saved):
            group.update(values)
    elif eng.comm.rank == 0:
        warnings.warn(f"the checkpoint has {len(saved)} optimizer param groups, the engine {len(groups)}: their "
                      "hyperparameters (lr, betas, weight_decay, ...) are not restored and keep the new config's "
                      "values", stacklevel=5)


def restore_counters(eng, counters: dict) -> None:
    """The saved step counters, and a new accumulation window and log-rate baseline from them. A
    checkpoint holds no gradient of a window in progress, and the saved micro-step count places
    boundaries by the saving run's gradient_accumulation_steps, which a load at another world size with
    the same train_batch_size changes (2 ranks x 3 micro-steps -> 3 ranks x 2): restored as saved, the
    first window after the load ended after one micro-step and every later one mixed two global
    batches. The step log's rate counts only the steps this process runs from here."""
    for key, value in counters.items():
        setattr(eng, key, value)
    eng.micro_steps = eng.global_steps * eng.config.gradient_accumulation_steps
    eng.logger.rebase(eng.global_steps)


def _load_engine_state(eng, state: dict, load_optimizer_states: bool, load_lr_scheduler_states: bool,
                       saved_precision: str | None) -> None:
    zopt = eng.zero_optimizer
    if load_optimizer_states and zopt is not None:
        # A loss scaler belongs to its precision: another one's (bf16's static 1 in an fp16 engine: no
        # dynamic scaling; fp16's dynamic 256 in a bf16 one) is not loaded; the config's stays.
        if state["guard"] is not None and saved_precision == precision_name(eng.config):
            zopt.guard.load_state_dict(state["guard"])
        _restore_param_groups(eng, state["param_groups"])
    if load_lr_scheduler_states and eng.lr_scheduler is not None and state["lr_scheduler"] is not None:
        eng.lr_scheduler.load_state_dict(state["lr_scheduler"])
    restore_counters(eng, state["counters"])
    loader = eng.training_dataloader
    if loader is not None and state["data_sampler"] is not None:
        loader.load_state_dict(_sampler_state(state["data_sampler"], eng.comm.world_size,
                                              eng.config.train_micro_batch_size_per_gpu))


def load_into(eng, path, load_module_strict: bool = True, load_optimizer_states: bool = True,
              load_lr_scheduler_states: bool = True, load_module_only: bool = False, world_comm=None):
    """Verify and load the checkpoint at `path` (a tag directory); returns its client_state. The
    checksums are spread over `world_comm` (every process; default the data-parallel group)."""
    comm = eng.comm
    verify(path, world_comm if world_comm is not None else comm, fmt.read_json(path / fmt.MANIFEST))
    src = FragmentSource(path)
    adapter = adapter_for(eng.zero_optimizer, comm.rank, comm.world_size)
    names = {id(p): n for n, p in eng.module.named_parameters()}
    trainable = {id(p): names[id(p)] for p in adapter.params()} if adapter else {}
    entries, _ = module_entries(eng.module, trainable)
    held = set(trainable.values()) | set(entries)
    _check_names(src, held, load_module_strict, stage_union(eng, held))
    load_state = load_optimizer_states and not load_module_only
    if load_state and adapter is not None:
        check_optimizer(path, src.meta, eng)
    layouts = tensor_shards.live_layouts(eng.module, coordinates(eng).model, model_degree(eng))
    tensor_shards.refuse_transposed_targets(eng.module, src)
    source = tensor_shards.LocalShards(src, layouts) if layouts else src  # a rank's own shards (its note)
    if adapter is not None:
        _load_trainable(source, adapter, names, load_state)
        eng.zero_optimizer.zero_grad()
    _load_module_entries(source, entries, adapter)
    state = load_torch(path / fmt.ENGINE_STATE, mmap=False)
    if not load_module_only:
        _load_engine_state(eng, state, load_state, load_lr_scheduler_states, src.meta.get("precision"))
        warn_if_mid_window_load(path, state)
        if load_state:
            load_rank_state(eng, src, *global_rank_and_world())
        _restore_rng(src, comm)
    return state["client_state"]


def _restore_rng(src: FragmentSource, comm) -> None:
    saved_world = src.meta["world_size"]  # every process of the saving job (placement.py's note)
    rank, world = global_rank_and_world()
    if saved_world != world and rank == 0:
        warnings.warn(f"checkpoint saved by {saved_world} ranks, loaded by {world}: ranks below "
                      f"{min(saved_world, world)} resume their RNG streams, others keep their seeds",
                      stacklevel=4)
    if rank < saved_world:
        set_rng_state(src.rank_extras(rank)["rng"])

