"""`dstrain`: command-line tools around a dstrain/DeepSpeed config and its checkpoints.

    dstrain check-config ds_config.json [--world-size N] [--set KEY=VALUE ...]
    dstrain ckpt consolidate CKPT_DIR [--tag TAG] --out FILE [--safetensors] [--dtype fp32|fp16|bf16]
    dstrain ckpt info CKPT_DIR [--no-verify]
    dstrain topology --world N [--pipe P] [--model T]
    dstrain estimate --params N | --model module:factory [--nodes N] [--gpus-per-node G] (estimate_cli.py)
    dstrain plot RUN_DIR [--out FILE.png]

`check-config` prints the resolved config as JSON (batch keys derived for the given data-parallel
world size) and exits 0, or prints one line per problem and exits 2. It runs every check
`engine.initialize` runs that does not need the model. `--set optimizer.params.lr=3e-4` sets a dotted
key first (the values of a template's "auto" keys; VALUE is read as JSON, else as a string), as
`initialize(config_overrides=...)` does. Deprecated keys and "auto" tunables left to DeepSpeed's
default are reported as warnings on stderr. `ckpt consolidate` writes one plain state dict (fp32 by
default; safetensors or torch format) that `model.load_state_dict` takes without dstrain; `ckpt info`
lists the tags of a checkpoint directory with world size, ZeRO stage, size and checksum status
(docs/checkpoints.md). `topology` prints the rank map of a pipe × data × model grid (docs/parallelism.md).

Exit codes: 0 ok, 1 bad or corrupted checkpoint, 2 invalid config or usage. This module imports no torch at import time, so that
checking a config stays fast; subcommands that need torch import it inside their handler.
"""
from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path
from typing import Callable, Optional, Sequence

EXIT_OK, EXIT_BAD_CHECKPOINT, EXIT_INVALID = 0, 1, 2


def _check_config(args: argparse.Namespace) -> int:
    from schemas import ConfigAutoWarning, ConfigDeprecationWarning, ConfigError, load_config

    told = (ConfigDeprecationWarning, ConfigAutoWarning)
    config, error = None, None
    with warnings.catch_warnings(record=True) as caught:
        for category in told:
            warnings.simplefilter("always", category)
        try:
            config = load_config(args.file, world_size=args.world_size, overrides=dict(args.set))
        except ConfigError as err:
            error = err
    for warning in caught:
        if issubclass(warning.category, told):
            print(f"warning: {warning.message}", file=sys.stderr)
    if error is not None:
        for line in str(error).splitlines():
            print(f"error: {line}", file=sys.stderr)
        count = len(error.problems)
        print(f"{args.file}: {count} problem{'s' if count != 1 else ''} found", file=sys.stderr)
        return EXIT_INVALID
    from .checkpoint.format import redact_secrets  # a terminal or CI log is no place for an api key
    resolved = {"world_size": config.world_size, **redact_secrets(config.to_dict())}
    print(json.dumps(resolved, indent=2))
    return EXIT_OK


def _key_value(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (e.g. optimizer.params.lr=3e-4), got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value  # a bare word is a string: --set optimizer.type=AdamW


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _add_check_config(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "check-config", help="validate a config and print it resolved",
        description="Validate a DeepSpeed/dstrain config (JSON or YAML) and print it resolved, "
                    "or print every problem (one per line) and exit 2.")
    parser.add_argument("file", help="path to a .json (comments allowed) or .yaml config")
    parser.add_argument("--world-size", type=_positive_int, default=1,
                        help="data-parallel world size for the batch arithmetic (default 1)")
    parser.add_argument("--set", type=_key_value, action="append", default=[], metavar="KEY=VALUE",
                        help="set a dotted key before checking, e.g. a template's \"auto\" value "
                             "(--set optimizer.params.lr=3e-4); VALUE is JSON or a plain string")
    parser.set_defaults(handler=_check_config)


def _ckpt(args: argparse.Namespace) -> int:
    from engine.checkpoint import CheckpointError
    from engine.checkpoint.consolidate import consolidate, info

    if not Path(args.dir).is_dir():  # info would list no tags and succeed; consolidate ask for a tag
        print(f"error: {args.dir}: no such checkpoint directory (give the save_dir holding `latest` and the tags)",
              file=sys.stderr)
        return EXIT_BAD_CHECKPOINT
    try:
        if args.ckpt_command == "info":
            report, healthy = info(args.dir, verify=not args.no_verify)
            print(report)
            return EXIT_OK if healthy else EXIT_BAD_CHECKPOINT
        out = consolidate(args.dir, args.out, tag=args.tag, safetensors=args.safetensors, dtype=args.dtype)
        print(f"wrote {out}")
        return EXIT_OK
    except (CheckpointError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_CHECKPOINT


def _add_ckpt(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("ckpt", help="inspect or consolidate dstrain checkpoints",
                                   description="Tools for dstrain checkpoint directories.")
    sub = parser.add_subparsers(dest="ckpt_command", metavar="COMMAND", required=True)
    cons = sub.add_parser("consolidate", help="write one plain state dict loadable without dstrain",
                          description="Join the fragments of every parameter into one state dict that "
                                      "model.load_state_dict() takes (zero_to_fp32's job, for any stage).")
    cons.add_argument("dir", help="checkpoint directory (the save_dir holding `latest` and tags)")
    cons.add_argument("--tag", default=None, help="tag to consolidate (default: the one `latest` names)")
    cons.add_argument("--out", required=True, help="output file")
    cons.add_argument("--safetensors", action="store_true", help="write safetensors instead of torch.save")
    cons.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), default="fp32",
                      help="dtype of floating-point tensors in the output (default fp32)")
    inf = sub.add_parser("info", help="list tags with world size, stage, size and checksum status")
    inf.add_argument("dir", help="checkpoint directory")
    inf.add_argument("--no-verify", action="store_true", help="skip re-hashing the files")
    parser.set_defaults(handler=_ckpt)


def _topology(args: argparse.Namespace) -> int:
    from .topology import Topology
    try:
        print(Topology.for_world(args.world, pipe=args.pipe, model=args.model).rank_map())
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_INVALID
    return EXIT_OK


def _add_topology(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("topology", help="print the rank map of a pipe × data × model grid",
                                   description="Coordinates and groups of every rank (model axis innermost).")
    parser.add_argument("--world", type=_positive_int, required=True, help="number of ranks")
    parser.add_argument("--pipe", type=_positive_int, default=1, help="pipeline stages (default 1)")
    parser.add_argument("--model", type=_positive_int, default=1, help="tensor-parallel degree (default 1)")
    parser.set_defaults(handler=_topology)


def _plot(args: argparse.Namespace) -> int:
    from engine.plot import PlotError, plot_run
    try:
        print(f"wrote {plot_run(args.run_dir, args.out)}")
        return EXIT_OK
    except PlotError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_INVALID


def _add_plot(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("plot", help="loss, lr, throughput and memory curves to a PNG",
                                   description="Draw the csv monitor's files (csv_monitor: <output_path>/"
                                               "<job_name>) as curves against global samples, in one PNG.")
    parser.add_argument("run_dir", help="the csv monitor's <output_path>/<job_name>, or a folder above it")
    parser.add_argument("--out", default=None, help="PNG to write (default RUN_DIR/dstrain_plot.png)")
    parser.set_defaults(handler=_plot)


# Each entry adds one subcommand; later issues append theirs (report).
from .estimate_cli import add_estimate  # noqa: E402 (no torch at import time either)

SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [_add_check_config, _add_ckpt, _add_topology,
                                                                    add_estimate, _add_plot]


def build_parser() -> argparse.ArgumentParser:
    """The `dstrain` argument parser with every registered subcommand."""
    parser = argparse.ArgumentParser(prog="dstrain", description="dstrain command-line tools")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add_subcommand in SUBCOMMANDS:
        add_subcommand(subparsers)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the `dstrain` console script; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "handler", None) is None:
        parser.print_help(sys.stderr)
        return EXIT_INVALID
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
