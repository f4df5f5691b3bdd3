"""The ``hf-spec`` command (also ``python -m hf_spec``): one module per subcommand, each defining its parser next
to its handler; `hf_spec.cli.common` holds the options they share. All command-line parsing lives here."""

from __future__ import annotations

import argparse
import sys

from hf_spec.cli import bench, distill, eval_draft, generate, train_head
from hf_spec.cli.common import model_arguments

SUBCOMMANDS = (generate, bench, eval_draft, distill, train_head)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="hf-spec", description="Exact speculative decoding for transformers.")
    commands = parser.add_subparsers(dest="command", required=True)
    shared = model_arguments()
    for subcommand in SUBCOMMANDS:
        subcommand.add_parser(commands, shared)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
