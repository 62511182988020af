"""The leak report's log lines, for the sidecar and the daemon alike.

The report (`Verdict.leak_detected`) is a warning, never an action, so a log line is how it
reaches a person who is not watching the dashboard: one when it goes up, with the rate, and one
when it comes down (the growth stopped, or a reinit or restart gave the detector a new baseline).
Each caller keeps its newest verdict (in its `Telemetry`) and passes it here with the new one.
"""

from __future__ import annotations

from typing import Any

from watchdog.core.verdict import Verdict


def log_change(log: Any, previous: Verdict | None, verdict: Verdict, **context: Any) -> None:
    """Log `leak_detected` or `leak_report_cleared` on `log` when the report changed since `previous`."""
    was_up = previous is not None and previous.leak_detected
    if verdict.leak_detected == was_up:
        return
    if verdict.leak_detected:
        log.warning("leak_detected", step=verdict.step, **context,
                    slope_bytes_per_step=round(verdict.slope_bytes_per_step),
                    slope_bytes_per_second=round(verdict.slope_bytes_per_second),
                    window_steps=round(verdict.window_steps), oom_projected=verdict.oom_projected,
                    explanation=verdict.explanation)
    else:
        log.info("leak_report_cleared", step=verdict.step, **context, status=verdict.status.value,
                 explanation=verdict.explanation)
