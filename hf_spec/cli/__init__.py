"""The ``hf-spec`` command (also ``python -m hf_spec``): one module per subcommand, each defining its parser next to
its handler; `hf_spec.cli.common` holds the options they share and the output convention. All command-line parsing
lives here.

Every error is one line on stderr, ``hf-spec <command>: error: <what, naming the option and its value>``, and exit
code 2; ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys

from transformers.utils import logging as transformers_logging

from hf_spec import __version__
from hf_spec.cli import bench, distill, eval_draft, generate, serve, train_head
from hf_spec.loading.pair import model_name

SUBCOMMANDS = (generate, serve, bench, eval_draft, distill, train_head)


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line (no usage block), exit code 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hf-spec", description="Exact speculative decoding for Hugging Face Transformers.",
                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--version", action="version", version=f"hf-spec {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for subcommand in SUBCOMMANDS:
        subcommand.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run a subcommand; its exit code (0, or 2 after a one-line error on stderr)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:  # --help, --version, or a bad option (already printed)
        return int(exit_.code or 0)
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="%(name)s: %(message)s")
    had_bars = transformers_logging.is_progress_bar_enabled()
    if getattr(args, "no_progress", False):  # transformers' own bars too (loading weights, saving shards)
        transformers_logging.disable_progress_bar()
    for option in ("target", "draft"):  # the names the loaders will use ($HF_SPEC_MODELS=tiny: the tiny pair)
        if isinstance(getattr(args, option, None), str):
            setattr(args, option, model_name(getattr(args, option)))
    args.report_stream = sys.stdout  # where `emit` writes; with --json nothing else may write there (a Trainer's logs)
    try:
        with contextlib.redirect_stdout(sys.stderr) if getattr(args, "json", False) else contextlib.nullcontext():
            return args.run(args)
    except Exception as error:
        if args.debug:
            raise
        kind = "" if isinstance(error, (ValueError, TypeError, ImportError, OSError)) else f"{type(error).__name__}: "
        print(f"hf-spec {args.command}: error: {kind}{error}", file=sys.stderr)
        return 2
    finally:
        if had_bars:  # as it was: a caller in the same process keeps its bars
            transformers_logging.enable_progress_bar()


if __name__ == "__main__":
    sys.exit(main())
