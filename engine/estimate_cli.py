"""`dstrain estimate`: per-rank memory for every ZeRO stage x offload choice, as a table.

    dstrain estimate --params 1.3e9 --nodes 2 --gpus-per-node 8 [--config ds_config.json] [--precision fp16]
    dstrain estimate --model examples.gpt:GPT
    dstrain estimate --params 4e6 --frozen-params 7e9 --config ds_config.json   # LoRA on a frozen 7B base

The numbers come from `offload.estimate.estimate_memory` (the ZeRO formulas plus buckets, gathered
stage-3 parameters and swap pools; docs/offload.md). `--config` takes the bucket sizes, buffer
counts, sub-group size and precision from a DeepSpeed config. Torch is imported only for `--model`.
"""
from __future__ import annotations

import argparse
import sys


def _count(text: str) -> int:
    try:
        value = int(float(text))
    except (ValueError, OverflowError):  # int(float("inf")) overflows, int(float("nan")) is a ValueError
        raise argparse.ArgumentTypeError(f"expected a finite count such as 1.3e9 or 8, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive count, got {text!r}")
    return value


def _settings(args: argparse.Namespace):
    from offload.estimate import EstimateSettings
    if args.config is None:
        return EstimateSettings(precision=args.precision or "fp16")
    from schemas import load_config
    config = load_config(args.config, world_size=args.nodes * args.gpus_per_node)  # the batch triple's world
    zero = config.zero_optimization
    optimizer, param = zero.offload_optimizer, zero.offload_param
    precision = args.precision or ("bf16" if config.bf16.enabled else "fp16" if config.fp16.enabled else "fp32")
    return EstimateSettings(precision=precision, reduce_bucket_size=zero.reduce_bucket_size,
                            max_live_parameters=zero.max_live_parameters, sub_group_size=zero.sub_group_size,
                            **({"optimizer_buffer_count": optimizer.buffer_count,
                                "swap_slots": optimizer.swap_slots, "swap_gradients": optimizer.swap_gradients,
                                "fast_init": optimizer.fast_init, "pipeline_read": optimizer.pipeline_read}
                               if optimizer else {}),
                            **({"param_buffer_count": param.buffer_count, "param_buffer_size": param.buffer_size,
                                "max_in_cpu": param.max_in_cpu} if param else {}))


def _estimate(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from offload.estimate import count_parameters, estimate_memory, format_bytes
    from schemas import ConfigError
    try:
        params, frozen = (args.params, args.frozen_params or 0) if args.params is not None else \
            count_parameters(args.model)
        if args.model is not None and args.frozen_params is not None:
            raise ValueError("--frozen-params goes with --params; --model counts its frozen parameters itself")
        settings = _settings(args)
    except (ValueError, ConfigError) as err:
        for line in str(err).splitlines():
            print(f"error: {line}", file=sys.stderr)
        return 2
    ranks = args.nodes * args.gpus_per_node
    also = f" (+ {frozen:,} frozen)" if frozen else ""
    table = Table(title=f"{params:,} parameters{also}, {ranks} data-parallel rank(s), {settings.precision}, Adam: "
                        f"model state per rank")
    for column in ("stage", "offload", "accelerator", "host", "NVMe"):
        table.add_column(column, justify="left" if column == "offload" else "right")
    for row in estimate_memory(params, args.nodes, args.gpus_per_node, settings, frozen=frozen):
        table.add_row(str(row.stage), row.offload, format_bytes(row.accelerator_bytes), format_bytes(row.host_bytes),
                      format_bytes(row.nvme_bytes) if row.nvme_bytes else "-")
    Console().print(table)
    return 0


def add_estimate(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("estimate", help="per-rank memory for each ZeRO stage and offload choice",
                                   description=__doc__.split("\n\n")[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", type=_count, help="trainable parameters (e.g. 1.3e9)")
    what.add_argument("--model", help="module:factory building the model (called with no arguments)")
    parser.add_argument("--frozen-params", type=_count, default=None,
                        help="with --params: parameters without gradients too (a LoRA base: weights only)")
    parser.add_argument("--nodes", type=_count, default=1)
    parser.add_argument("--gpus-per-node", type=_count, default=1)
    parser.add_argument("--config", default=None, help="DeepSpeed config for buckets, pools and precision")
    parser.add_argument("--precision", choices=("fp16", "bf16", "fp32"), default=None,
                        help="weights/gradients precision (default: the config's, else fp16)")
    parser.set_defaults(handler=_estimate)
