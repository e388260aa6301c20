"""`dstrain`: command-line tools around a dstrain/DeepSpeed config and its checkpoints.

    dstrain check-config ds_config.json [--world-size N]

`check-config` prints the resolved config as JSON (batch keys derived for the given data-parallel
world size) and exits 0, or prints one line per problem and exits 2. Deprecated keys are reported as
warnings on stderr. Later subcommands (`ckpt consolidate`, `ckpt info`, `report`) register here too.

Exit codes: 0 ok, 2 invalid config or usage. This module imports no torch at import time, so that
checking a config stays fast; subcommands that need torch import it inside their handler.
"""
from __future__ import annotations

import argparse
import json
import sys
import warnings
from typing import Callable, Optional, Sequence

EXIT_OK, EXIT_INVALID = 0, 2


def _check_config(args: argparse.Namespace) -> int:
    from schemas import ConfigDeprecationWarning, ConfigError, load_config

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConfigDeprecationWarning)
        try:
            config = load_config(args.file, world_size=args.world_size)
        except ConfigError as err:
            for line in str(err).splitlines():
                print(f"error: {line}", file=sys.stderr)
            count = len(err.problems)
            print(f"{args.file}: {count} problem{'s' if count != 1 else ''} found", file=sys.stderr)
            return EXIT_INVALID
    for warning in caught:
        if issubclass(warning.category, ConfigDeprecationWarning):
            print(f"warning: {warning.message}", file=sys.stderr)
    resolved = {"world_size": config.world_size, **config.to_dict()}
    print(json.dumps(resolved, indent=2))
    return EXIT_OK


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
    parser.set_defaults(handler=_check_config)


# Each entry adds one subcommand; later issues append theirs (ckpt consolidate, ckpt info, report).
SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [_add_check_config]


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
