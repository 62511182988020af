"""A process that grows its resident memory at a steady rate, for the daemon's process-level tests.

    python hog.py [--mib-per-second R] [--ignore-term] [--pidfile F] [--children N] [--tag TEXT]

`--ignore-term`: SIGTERM is ignored (a job that never checkpoints on preemption). `--children`:
N sleeping children in the same process group. `--tag` only makes the command line unique.
"""

import argparse
import os
import signal
import subprocess
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("--mib-per-second", type=float, default=0.0)
parser.add_argument("--ignore-term", action="store_true")
parser.add_argument("--pidfile")
parser.add_argument("--children", type=int, default=0)
parser.add_argument("--tag", default="")
args = parser.parse_args()

if args.ignore_term:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
children = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]) for _ in range(args.children)]
if args.pidfile:
    with open(args.pidfile + ".tmp", "w") as handle:
        handle.write(str(os.getpid()))
    os.replace(args.pidfile + ".tmp", args.pidfile)
print(f"ready pid={os.getpid()} children={','.join(str(c.pid) for c in children)}", flush=True)
kept = []
chunk = int(args.mib_per_second * (1 << 20) / 20)
while True:
    if chunk:
        kept.append(b"\x01" * chunk)  # written, so resident
    time.sleep(0.05)
