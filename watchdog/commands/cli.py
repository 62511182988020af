"""`hbm-watchdog`: predict device-memory exhaustion in training jobs and act before it.

Each subcommand lives in its own module exposing `configure(parser)` and `run(args) -> int`;
this file only routes. Modules import heavy dependencies (torch) inside `run`, so `--help`
and `analyze` start fast. Any `InputError` becomes one line on stderr and exit status 2, and so
do argparse's own refusals (a bad option, a value an option's `type=` refuses: numbers go
through `watchdog.core.numbers`) and a `watchdog` package shared with the file-events package of
that name (`clash.py`), which is checked before anything else is imported.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from watchdog.commands.clash import name_clash
from watchdog.core.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED, InputError
from watchdog.core.printable import PrintableStream, printable
from watchdog.logs import LEVELS, configure_logging, open_log_file

COMMANDS = {
    "train": ("watchdog.trainer.cli", "run the instrumented trainer with the watchdog attached"),
    "analyze": ("watchdog.commands.analyze", "replay trace CSVs through the online detector and policy"),
    "supervise": ("watchdog.commands.supervise", "run a command, restarting it on exit 42, 43 or 44, an OOM "
                                                 "or a death by a signal (never on 45: restarting in vain)"),
    "bench": ("watchdog.bench.cli", "detector quality and speed against the baselines"),
    "report": ("watchdog.commands.report", "draw a trace: usage, floor, trend, projection, limit, actions"),
    "watch": ("watchdog.commands.watch", "a daemon that signals a job before its OOM, from outside its process"),
    "postmortem": ("watchdog.commands.postmortem", "how a run ended: its trace, flight record, exit and out-of-memory "
                                                   "message (XLA's or PyTorch CUDA's): a diagnosis"),
    "goodput": ("watchdog.commands.goodput", "where a job's time went: goodput, badput by cause, what actions saved"),
}


# Options that mean something only with another's value: given without it, they would be ignored
# silently, so they are refused (one line, exit status 2). (command, option's dest, its flag, the
# other's dest, the value it needs, how the user gives that value.)
NEEDS = (("train", "replay_trace", "--replay-trace", "memory_source", "replay", "--memory-source replay"),)


def ignored_option(args: argparse.Namespace) -> str | None:
    """What the user gave that the command would ignore, in words; None when nothing is."""
    for command, dest, flag, other, value, needed in NEEDS:
        if args.command == command and getattr(args, dest, None) not in (None, False, []) \
                and getattr(args, other, None) != value:
            return f"{flag} is read only with {needed}; without it, it would be ignored"
    return None


class OneLineParser(argparse.ArgumentParser):
    """argparse, refusing in one line and exit status 2 like an InputError (no usage block: `--help` has it)."""

    def error(self, message: str):
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {_one_line(message)}\n")


def _one_line(message: str) -> str:
    return printable(message)  # a path or a value may hold a newline, or a terminal's escape sequence


class DefaultsShown(argparse.HelpFormatter):
    """Every option's help ends with its default, unless it already says one (in its own words):
    `train --help` showed none for --seed, --batch-size, --depth and others."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        nothing = default is None or default is False or default is argparse.SUPPRESS or default in ([], ())
        if "default" in text or nothing or not action.option_strings or action.nargs == 0:
            return text
        return f"{text} (default %(default)s)" if text else "default %(default)s"


def build_parser() -> argparse.ArgumentParser:
    from watchdog import __version__

    # No abbreviations of the global options: `postmortem --log FILE` is the subcommand's, not `--log-level`.
    parser = OneLineParser(prog="hbm-watchdog", description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"hbm-watchdog {__version__}")
    parser.add_argument("--log-format", choices=("auto", "json", "console"), default="auto",
                        help="log rendering (default: console on a TTY, JSON lines otherwise)")
    parser.add_argument("--log-level", choices=LEVELS, default="info",
                        help="least severe events shown (default: info; on a console, routine start-up "
                             "detail appears only at debug)")
    parser.add_argument("--log-file", metavar="PATH",
                        help="also append every event to PATH as JSON lines, whatever --log-format shows")
    parser.add_argument("--quiet", "-q", action="store_true",
                        help="warnings and errors only, and no progress bar (the end-of-run summary still prints)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(module_name)
        command = sub.add_parser(name, help=help_text, description=help_text, formatter_class=DefaultsShown)
        module.configure(command)
        command.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    clash = name_clash()
    if clash:
        print(f"hbm-watchdog: error: {clash}", file=sys.stderr)
        return EXIT_BAD_INPUT
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help and --version (0), or a refusal already printed in one line (2)
        return exc.code if isinstance(exc.code, int) else EXIT_BAD_INPUT
    ignored = ignored_option(args)
    if ignored is not None:
        print(f"hbm-watchdog {args.command}: error: {_one_line(ignored)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        log_file = open_log_file(args.log_file) if args.log_file else None
    except InputError as exc:
        print(f"hbm-watchdog {args.command}: error: {_one_line(str(exc))}", file=sys.stderr)
        return EXIT_BAD_INPUT
    configure_logging(args.log_format, "warning" if args.quiet else args.log_level, log_file, args.log_file)
    stdout, sys.stdout = sys.stdout, PrintableStream(sys.stdout)  # what a command prints of a file never acts
    try:
        return int(args._run(args) or 0)
    except InputError as exc:
        print(f"hbm-watchdog {args.command}: error: {_one_line(str(exc))}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print(f"hbm-watchdog {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        sys.stdout = stdout


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
