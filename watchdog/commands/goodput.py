"""`hbm-watchdog goodput PATH [--json]`: where a job's time went, after the fact.

PATH is a job file (`HBMWATCH_JOB_FILE`, or supervise's `--job-file`), or a trace CSV whose job
file lies beside it (`TRACE.job.jsonl`). Every process of the job appended its share to it
(`records/job_ledger.py`); the accounting is `core/goodput.py`'s: goodput, badput by cause, the
steps kept and redone, and what each checkpoint action cost against what a crash at its
projected OOM would have cost (an estimate, labelled as one).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from watchdog.core import goodput, strict_json
from watchdog.core.errors import InputError


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", metavar="PATH", help="a job file, or the trace CSV it lies beside")
    parser.add_argument("--json", action="store_true", help="one JSON object")


def job_file_of(path: Path) -> Path:
    """The job file PATH names: itself, or the one beside the trace it names."""
    if path.name.endswith(goodput.SUFFIX):
        return path
    beside = Path(goodput.path_beside(path))
    if beside.exists():
        return beside
    if not path.exists():
        raise InputError(f"{path}: no such file, and no job file beside it ({beside.name})")
    if path.suffix == ".csv":
        raise InputError(f"{path}: no job file beside this trace ({beside.name}); the trainer writes one "
                         "beside its --trace-file, or where supervise --job-file says")
    return path


def run(args: argparse.Namespace) -> int:
    path = job_file_of(Path(args.path))
    records = goodput.read(path)
    if not any(r["event"] == "process" for r in records):
        raise InputError(f"job file {path}: no process recorded in it (a loop records itself through its "
                         "Watchdog; a script that cannot change, through `hbm-watchdog watch` beside it)")
    account = goodput.account(records)
    print(strict_json.dumps(account.fields()) if args.json else account.block())
    return 0
