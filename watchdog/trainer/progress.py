"""Progress: a tqdm bar on a terminal, a structured log line every `log_every` steps otherwise.

The loss is read only every `log_every` steps, after the step's sync: reading it is a
device-to-host transfer, and on XLA one per step would cost more than the watchdog does.
Memory and the watchdog's status come from its telemetry cache, never from the runtime.
"""

from __future__ import annotations

import sys
import time

import torch

from watchdog.logs import get_logger

log = get_logger("watchdog.trainer")


class Progress:
    def __init__(self, steps_total: int, first_step: int, log_every: int, bar: bool | None = None):
        self.steps_total, self.log_every = steps_total, log_every
        self.losses: dict[int, float] = {}
        self._last_time, self._last_step = time.perf_counter(), first_step
        self._bar = None
        if bar if bar is not None else sys.stderr.isatty():
            try:
                from tqdm import tqdm  # the `progress` extra; without it, log lines on a terminal too
            except ImportError:
                return
            self._bar = tqdm(total=steps_total, initial=first_step, unit="step", dynamic_ncols=True)

    def update(self, step: int, loss: torch.Tensor, watchdog) -> None:
        if self._bar is not None:
            self._bar.update(1)
        done = step + 1
        if done % self.log_every and done != self.steps_total:
            return
        value = float(loss.item())
        self.losses[step] = value
        now = time.perf_counter()
        rate = (done - self._last_step) / (now - self._last_time) if now > self._last_time else 0.0
        self._last_time, self._last_step = now, done
        fields = {"step": step, "loss": round(value, 4), "steps_per_second": round(rate, 2)}
        fields.update(_watchdog_fields(watchdog))
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{value:.3f}", memory=fields.get("memory_mib"),
                                  watchdog=fields.get("watchdog"), refresh=False)
        else:
            log.info("train_progress", **fields)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _watchdog_fields(watchdog) -> dict:
    if watchdog is None:
        return {}
    telemetry = watchdog.telemetry
    sample, verdict = telemetry.sample, telemetry.verdict
    fields = {"watchdog": verdict.status.value if verdict is not None else "starting"}
    if sample is not None:
        fields["memory_mib"] = round(sample.bytes_used / 2**20, 1)
    if verdict is not None and verdict.projected_oom_step is not None:
        fields["projected_oom_step"] = verdict.projected_oom_step
    return fields
