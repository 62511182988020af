"""The README's "A loop of your own", nothing else: no logging set up, a leak in host memory (the
`rss` source), `carry_out(save, rebuild)`. For tests of what a newcomer's terminal or pipe shows."""

import sys
import time

from watchdog import Watchdog, WatchdogConfig
from watchdog.readers.host_memory import job_memory

kept = []


def save():
    return "ckpt.pt"


def rebuild():
    kept.clear()


limit = job_memory() + (240 << 20)
with Watchdog(WatchdogConfig(sample_every=2, source="rss", memory_limit_bytes=limit, forensics=False)) as wd:
    for step in range(400):
        kept.append(bytearray(b"\x01") * (4 << 20))  # written, so resident
        time.sleep(0.01)  # the rest of a training step
        action = wd.step(step)
        if action is not None and not wd.carry_out(action, save=save, rebuild=rebuild):
            sys.exit(42)
        if wd.last_action is not None:  # handed over on this thread (a decision's count is the sidecar's)
            break
