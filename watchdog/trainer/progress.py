"""Progress: a tqdm bar on a terminal, and a structured log line every `log_every` steps.

The loss is read only every `log_every` steps, after the step's sync: reading it is a
device-to-host transfer, and on XLA one per step would cost more than the watchdog does.
Memory and the watchdog's status come from its telemetry cache, never from the runtime.

While the bar is drawn, log records go through `tqdm.write` (tqdm's logging redirection), so an
event printed by the sidecar thread lands above the bar instead of inside its line, and the bar
stays one line at the bottom.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time

import torch

from watchdog.core.units import format_bytes, format_duration
from watchdog.core.verdict import Status
from watchdog.logs import get_logger

log = get_logger("watchdog.trainer")


class Progress:
    def __init__(self, steps_total: int, first_step: int, log_every: int, bar: bool | None = None):
        self.steps_total, self.log_every = steps_total, log_every
        self.losses: dict[int, float] = {}
        self._previous_time, self._previous_step = time.perf_counter(), first_step
        self._bar = None
        self._redirect = contextlib.ExitStack()
        if bar if bar is not None else sys.stderr.isatty():
            try:
                from tqdm import tqdm  # the `progress` extra; without it, log lines on a terminal too
                from tqdm.contrib.logging import logging_redirect_tqdm
            except ImportError:
                return
            self._bar = tqdm(total=steps_total, initial=first_step, unit="step", dynamic_ncols=True)
            self._redirect.enter_context(logging_redirect_tqdm())

    def update(self, step: int, loss: torch.Tensor, watchdog) -> None:
        if self._bar is not None:
            self._bar.update(1)
        done = step + 1
        if done % self.log_every and done != self.steps_total:
            return
        value = float(loss.item())
        self.losses[step] = value
        now = time.perf_counter()
        rate = (done - self._previous_step) / (now - self._previous_time) if now > self._previous_time else 0.0
        self._previous_time, self._previous_step = now, done
        if self._bar is not None:
            self._bar.set_postfix_str(bar_text(value, watchdog), refresh=False)
        # logged under the bar too: the console shows it only at debug (a routine event), a
        # --log-file keeps it
        log.info("train_progress", step=step, loss=round(value, 4), steps_per_second=round(rate, 2),
                 **_watchdog_fields(watchdog))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        self._redirect.close()


def bar_text(loss: float, watchdog) -> str:
    """What the bar shows after the step count: `loss 0.912 | 1.88 GiB / 2.00 GiB | leaking, OOM in ~8 s (step 271)`."""
    parts = [f"loss {loss:.3f}"]
    if not watchdog.watches:  # an unwatched run
        return parts[0]
    sample, verdict = watchdog.telemetry.sample, watchdog.telemetry.verdict
    if sample is not None:
        limit = verdict.limit_bytes if verdict is not None else None
        parts.append(format_bytes(sample.bytes_used, 2) + (f" / {format_bytes(limit, 2)}" if limit else ""))
    if verdict is None:
        parts.append("watchdog starting")
        return " | ".join(parts)
    status = verdict.status.label
    if verdict.projected_oom_step is not None and math.isfinite(verdict.projected_oom_steps):
        when = (f"~{format_duration(verdict.projected_oom_seconds)}" if math.isfinite(verdict.projected_oom_seconds)
                else f"{verdict.projected_oom_steps:,.0f} steps")
        status = ("OOM projected" if verdict.status is Status.OOM_PROJECTED else f"{status}, OOM") + \
            f" in {when} (step {verdict.projected_oom_step:,})"
    elif verdict.slope_bytes_per_step > 0 and status != "healthy":
        status += f", +{format_bytes(verdict.slope_bytes_per_step)}/step"
    parts.append(status)
    return " | ".join(parts)


def _watchdog_fields(watchdog) -> dict:
    """Raw fields for the JSON progress line (base units: the log pipeline's contract)."""
    if not watchdog.watches:  # an unwatched run
        return {}
    telemetry = watchdog.telemetry
    sample, verdict = telemetry.sample, telemetry.verdict
    fields = {"watchdog": verdict.status.value if verdict is not None else "starting"}
    if sample is not None:
        fields["memory_mib"] = round(sample.bytes_used / 2**20, 1)
    if verdict is not None and verdict.projected_oom_step is not None:
        fields["projected_oom_step"] = verdict.projected_oom_step
    return fields
