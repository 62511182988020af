"""Command-line options renamed, kept for one release: still accepted, hidden from --help, and each
use prints one line saying what to write instead (docs/CHANGELOG.md lists them)."""

from __future__ import annotations

import argparse
import sys


class _Renamed(argparse.Action):
    def __init__(self, option_strings, dest, *, new: str, **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(f"hbm-watchdog: {option_string} is deprecated and goes in the next release; "
              f"write {self.new}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def renamed_option(parser: argparse.ArgumentParser, old: str, new: str, **kwargs) -> None:
    """`old` as a hidden alias of the option `new` (already added): the same value, the same `dest`."""
    dest = new.lstrip("-").replace("-", "_")
    parser.add_argument(old, dest=dest, action=_Renamed, new=new, help=argparse.SUPPRESS,
                        default=argparse.SUPPRESS, **kwargs)
