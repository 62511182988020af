"""`hbm-watchdog supervise [--max-restarts N] [--backoff S] [--kill-grace S] -- CMD ...`: restart CMD on
exit 42 or an OOM crash.

The loop itself, its decisions and its exit statuses are in `watchdog.actions.supervisor`; the
job's process group (signalled whole, ended whatever happens to the supervisor) in
`watchdog.actions.job_group`.
"""

from __future__ import annotations

import argparse

from watchdog.actions.supervisor import DEFAULT_KILL_GRACE, supervise
from watchdog.core.numbers import option, parse_count


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-restarts", type=option(parse_count), default=3, metavar="N",
                        help="restarts allowed before giving up with status 1 (default 3)")
    parser.add_argument("--backoff", type=float, default=1.0, metavar="SECONDS",
                        help="wait before the first restart; doubles each time (default 1)")
    parser.add_argument("--max-backoff", type=float, default=60.0, metavar="SECONDS",
                        help="cap on the wait between restarts (default 60)")
    parser.add_argument("--kill-grace", type=float, default=DEFAULT_KILL_GRACE, metavar="SECONDS",
                        help="after SIGTERM or SIGINT is forwarded to the job's process group (or what is "
                             "left of it once the command exits), SIGKILL it this much later "
                             f"(default {DEFAULT_KILL_GRACE:g}: time to save a checkpoint)")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ...", help="the command to run")


def run(args: argparse.Namespace) -> int:
    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    return supervise(command, max_restarts=args.max_restarts, backoff=args.backoff, max_backoff=args.max_backoff,
                     kill_grace=args.kill_grace)
