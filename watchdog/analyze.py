"""Placeholder: this subcommand lands with its issue."""

from __future__ import annotations

import argparse
import sys

from watchdog.errors import EXIT_BAD_INPUT


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("rest", nargs=argparse.REMAINDER)


def run(args: argparse.Namespace) -> int:
    print(f"hbm-watchdog {args.command}: not available yet in this version", file=sys.stderr)
    return EXIT_BAD_INPUT
