"""`hbm-watchdog report TRACE -o FILE.png|FILE.html`: the picture of a trace, as the watchdog saw it.

The trace is replayed through the online detector and policy (`replay_steps`, the same path as
`analyze` and the sidecar), so the floor, trend, interval and markers are what the live watchdog
would have had at each step, not a hindsight fit. Drawn: memory used (thin), the floor, the fitted
trend with its slope interval and its projection to the limit, the limit, the spans of the two
signals (the leak reported; an OOM projected), and the steps where actions were asked for. `.html` embeds the PNG (base64) with a
summary table, so the page is one self-contained file.
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import math
import os
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

from watchdog.core.errors import InputError
from watchdog.core.numbers import option
from watchdog.core.sample import Sample, load_trace
from watchdog.core.units import format_bytes, positive_size
from watchdog.core.verdict import Action, Status, Verdict
from watchdog.fileio import write_atomically

GiB = float(1 << 30)
SUFFIXES = (".png", ".html")


@dataclass
class ReplayPicture:
    """Everything the picture needs, collected in one pass over the replay."""

    steps: list[int] = field(default_factory=list)
    used: list[float] = field(default_factory=list)
    floor: list[float] = field(default_factory=list)  # nan while warming up
    oom_projected: list[bool] = field(default_factory=list)  # the action path's signal
    reported: list[bool] = field(default_factory=list)  # the leak report (a warning)
    actions: list[tuple[int, Action]] = field(default_factory=list)
    first_action_verdict: Verdict | None = None
    final_verdict: Verdict | None = None
    limit: float | None = None

    @property
    def trend_verdict(self) -> Verdict | None:
        """The fit to draw: when the watchdog acted (that is the decision to explain), else the last one."""
        return self.first_action_verdict or self.final_verdict


FLOOR_SAMPLES = 16  # the drawn floor: the lowest of this many newest samples


def collect(samples: list[Sample], memory_limit_bytes: int | None = None) -> ReplayPicture:
    """One pass over the replay. The floor drawn is the lowest of the newest `FLOOR_SAMPLES` samples
    (what "resident memory" means), not the detector's fitted floor: after a reinit the fit, still
    spanning the drop, sat 0.2 GiB below every sample."""
    from collections import deque

    from watchdog.core.replay import replay_steps

    picture = ReplayPicture()
    newest: deque[float] = deque(maxlen=FLOOR_SAMPLES)
    for sample, verdict, action in replay_steps(samples, memory_limit_bytes=memory_limit_bytes):
        picture.steps.append(sample.step)
        picture.used.append(sample.bytes_used / GiB)
        newest.append(sample.bytes_used / GiB)
        picture.floor.append(min(newest) if verdict.status is not Status.WARMING_UP else math.nan)
        picture.oom_projected.append(verdict.status is Status.OOM_PROJECTED)
        picture.reported.append(verdict.leak_detected)
        if action is not None and action is not Action.NONE:
            picture.actions.append((sample.step, action))
            if action.needs_checkpoint and picture.first_action_verdict is None:
                picture.first_action_verdict = verdict
        picture.final_verdict = verdict
    final = picture.final_verdict  # its limit is the judge's: the smaller of the budget and the device's
    picture.limit = float(final.limit_bytes) if final is not None and final.limit_bytes else None
    return picture


def _spans(steps: list[int], up: list[bool]) -> list[tuple[int, int]]:
    spans, start = [], None
    for step, is_up in zip(steps, up):
        if is_up and start is None:
            start = step
        elif not is_up and start is not None:
            spans.append((start, step))
            start = None
    if start is not None:
        spans.append((start, steps[-1]))
    return spans


ACTION_STYLE = {
    Action.WARN: ("#e69f00", "warning"),
    Action.CHECKPOINT_REINIT: ("#d55e00", "checkpoint + reinit"),
    Action.CHECKPOINT_RESTART: ("#7b2d8e", "checkpoint + restart (exit 42)"),
}


def _draw_trend(ax, verdict: Verdict, limit: float | None, first_step: int, last_step: int) -> None:
    """Fitted floor trend over the recent past, and floor + excursion projected to the limit with its fan.

    The projection is cut at half the trace's length past its end, so a far-away OOM does not
    squash the picture of what actually happened.
    """
    if verdict.floor_bytes is None or verdict.slope_bytes_per_step <= 0:
        return
    s0, floor0 = verdict.step, verdict.floor_bytes
    horizon = last_step + max(1, (last_step - first_step) // 2)
    back = max(first_step, s0 - max(1, int(0.3 * (s0 - first_step))))
    ax.plot([back, s0], [(floor0 - verdict.slope_bytes_per_step * (s0 - back)) / GiB, floor0 / GiB],
            color="#0072b2", lw=2.2, label=f"fitted trend ({format_bytes(verdict.slope_bytes_per_step)}/step)")
    if limit is None:
        return
    peak0 = floor0 + verdict.excursion_bytes
    oom = verdict.projected_oom_step or int(s0 + max(0.0, limit - peak0) / verdict.slope_bytes_per_step)
    if oom <= s0:
        return  # already at the limit: nothing to project
    end = min(oom, horizon)
    xs = [s0, end]
    ax.plot(xs, [peak0 / GiB, (peak0 + verdict.slope_bytes_per_step * (end - s0)) / GiB], color="#0072b2",
            lw=1.6, ls="--", label="projection of floor + transient to the limit")
    low, high = verdict.slope_low_bytes_per_step, verdict.slope_high_bytes_per_step
    if high > low:
        ax.fill_between(xs, [peak0 / GiB] * 2,
                        [min(limit, peak0 + low * (end - s0)) / GiB, min(limit, peak0 + high * (end - s0)) / GiB],
                        color="#0072b2", alpha=0.15, lw=0, label="slope interval")
    if verdict.projected_oom_step is not None and s0 < verdict.projected_oom_step <= horizon:
        ax.plot([verdict.projected_oom_step], [limit / GiB], marker="v", color="#0072b2", ms=9, ls="none",
                label=f"projected OOM at step {verdict.projected_oom_step:,}")


def draw(picture: ReplayPicture, title: str, true_oom_step: int | None = None):
    """A matplotlib Figure (Agg) of one replay; `true_oom_step` marks a benchmark trace's known OOM."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(14, 6.2), dpi=110, layout="constrained")
    ax = fig.add_subplot()
    steps = picture.steps
    ax.plot(steps, picture.used, color="#9a9a9a", lw=0.4, alpha=0.7, label="memory used (samples)")
    ax.plot(steps, picture.floor, color="#009e73", lw=1.6, label="floor (resident memory)")
    for i, (start, stop) in enumerate(_spans(steps, picture.reported)):  # the two signals, never one band
        ax.axvspan(start, stop, ymin=0.0, ymax=0.03, color="#e69f00", alpha=0.9, lw=0,
                   label="leak reported (warning)" if i == 0 else None)
    for i, (start, stop) in enumerate(_spans(steps, picture.oom_projected)):
        ax.axvspan(start, stop, color="#d55e00", alpha=0.08, lw=0, label="OOM projected (action alarm)" if i == 0 else None)
    if picture.trend_verdict is not None:
        _draw_trend(ax, picture.trend_verdict, picture.limit, steps[0], steps[-1])
    if picture.limit is not None:
        ax.axhline(picture.limit / GiB, color="#cc0000", lw=1.4, label=f"limit {format_bytes(picture.limit, 2)}")
    seen: set[Action] = set()
    for step, action in picture.actions:
        color, name = ACTION_STYLE.get(action, ("black", action.value))
        ax.axvline(step, color=color, lw=1.4 if action.needs_checkpoint else 0.8,
                   ls="-" if action.needs_checkpoint else ":", label=None if action in seen else f"{name}")
        seen.add(action)
    if true_oom_step is not None:
        ax.axvline(true_oom_step, color="black", lw=1.0, ls="-.", label=f"true OOM step {true_oom_step:,}")
    ax.set_xlabel("training step")
    ax.set_ylabel("device memory (GiB)")
    ax.grid(alpha=0.25)
    ax.xaxis.set_major_formatter(_thousands())
    top = max(max(picture.used), picture.limit / GiB if picture.limit else 0.0)
    ax.set_ylim(0, top * 1.08)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8.5, framealpha=0.9)  # beside the data, never on it
    # The title carries the trace's file name, which may hold `$...$`: text, never mathtext.
    ax.set_title("\n".join(textwrap.wrap(title, 110)), fontsize=10.5, loc="left", parse_math=False)
    return fig


def _thousands():
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda x, _pos: f"{x:,.0f}")


def _title(name: str, picture: ReplayPicture) -> str:
    """The story the summary tells too: the first action and what it was decided on, and how many
    followed; else how the trace ended."""
    verdict = picture.final_verdict
    if verdict is None:
        return name
    acted = [step for step, action in picture.actions if action.needs_checkpoint]
    if picture.first_action_verdict is not None:
        more = f" ({len(acted) - 1} more action{'s' if len(acted) > 2 else ''} after it)" if len(acted) > 1 else ""
        return f"{name}: first action at step {acted[0]:,}: {picture.first_action_verdict.explanation}{more}"
    return f"{name}: {verdict.explanation or verdict.status.value}"


def summary_rows(name: str, samples: list[Sample], picture: ReplayPicture) -> list[tuple[str, str]]:
    final = picture.final_verdict
    first_projected = next((s for s, up in zip(picture.steps, picture.oom_projected) if up), None)
    first_report = next((s for s, up in zip(picture.steps, picture.reported) if up), None)
    first_action = next(((s, a) for s, a in picture.actions if a.needs_checkpoint), None)
    actions = sum(1 for _, a in picture.actions if a.needs_checkpoint)
    return [
        ("trace", name),
        ("samples", f"{len(samples):,} (steps {samples[0].step:,} to {samples[-1].step:,})"),
        ("limit", format_bytes(picture.limit, 2)),
        ("final status", final.status.value if final else "n/a"),
        ("floor slope", f"{format_bytes(final.slope_bytes_per_step)}/step" if final else "n/a"),
        ("projected OOM step", f"{final.projected_oom_step:,}" if final and final.projected_oom_step else "none"),
        ("leak first reported", f"step {first_report:,}" if first_report is not None else "never"),
        ("OOM first projected", f"step {first_projected:,}" if first_projected is not None else "never"),
        ("first action", f"{first_action[1].value} at step {first_action[0]:,}" if first_action else "none"),
        ("decided on", picture.first_action_verdict.explanation if picture.first_action_verdict else "-"),
        ("checkpoint actions", f"{actions:,}"),
        ("at the end", final.explanation if final else ""),
    ]


def draw_trace(samples: list[Sample], output: str | Path, *, name: str = "trace",
               memory_limit_bytes: int | None = None, true_oom_step: int | None = None) -> Path:
    """Replay, draw and write `output` (.png or .html). Returns the path written."""
    output = Path(output)
    check_output(output)
    if not samples:
        raise InputError(f"{name}: the trace has no samples")
    try:
        import matplotlib

        matplotlib.use("Agg")
    except ImportError:
        raise InputError("report needs matplotlib: pip install 'hbm-watchdog[report]'") from None
    picture = collect(samples, memory_limit_bytes)
    figure = draw(picture, _title(name, picture), true_oom_step)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    png = buffer.getvalue()
    if output.suffix.lower() == ".png":
        _write_atomically(output, png)
    else:
        _write_atomically(output, _html_page(name, png, summary_rows(name, samples, picture)).encode("utf-8"))
    return output


def check_output(output: Path) -> None:
    """Refuse an output the report could not be written to, before the replay and drawing."""
    if output.suffix.lower() not in SUFFIXES:
        raise InputError(f"{output}: output must end in .png or .html")
    folder = output.parent
    if output.is_dir():
        raise InputError(f"{output}: is a directory")
    if not folder.exists():
        raise InputError(f"{output}: folder {folder} does not exist")
    if not folder.is_dir():
        raise InputError(f"{output}: {folder} is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK) or (output.exists() and not os.access(output, os.W_OK)):
        raise InputError(f"{output}: not writable (read-only file system or no permission)")


def _write_atomically(output: Path, data: bytes) -> None:
    """All of the new report or, on a failure (disk full), the old one untouched and one line why."""
    try:
        write_atomically(output, data)
    except OSError as exc:
        raise InputError(f"{output}: cannot write it: {exc.strerror or exc}") from None


def _html_page(name: str, png: bytes, rows: list[tuple[str, str]]) -> str:
    cells = "\n".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows)
    image = base64.b64encode(png).decode("ascii")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>hbm-watchdog report: {html.escape(name)}</title>
<style>body{{font-family:system-ui,sans-serif;margin:2em;max-width:1400px}}
table{{border-collapse:collapse;margin-top:1em}}th,td{{text-align:left;padding:.3em .8em;border-bottom:1px solid #ddd}}
img{{max-width:100%}}</style></head>
<body><h1>hbm-watchdog report: {html.escape(name)}</h1>
<img alt="memory of {html.escape(name)}" src="data:image/png;base64,{image}">
<table>
{cells}
</table></body></html>
"""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", help="trace CSV (step,timestamp,bytes_used,bytes_limit,peak_bytes_used[,phase])")
    parser.add_argument("-o", "--output", required=True, metavar="FILE",
                        help="FILE.png for the picture, FILE.html for a page with the picture and a summary")
    parser.add_argument("--memory-limit", metavar="SIZE", default=None, type=option(positive_size),
                        help="memory budget (512MiB, 16GiB); lower than the device's limit, or where none is recorded")


def run(args: argparse.Namespace) -> int:
    check_output(Path(args.output))
    samples = load_trace(args.trace)
    path = draw_trace(samples, args.output, name=Path(args.trace).name, memory_limit_bytes=args.memory_limit)
    print(f"wrote {path}")
    return 0
