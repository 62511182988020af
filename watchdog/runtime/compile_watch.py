"""Steady-state recompilation, watched from the sidecar: counter -> finding -> captured cause -> log.

At every memory sample on XLA the compilation counter goes to the `RecompilationDetector`. When
it raises a finding, torch_xla's compile analysis is captured (see `xla_stats`) until
`capture_compiles` compilations have been explained or `capture_steps` steps have passed; then one
WARN event, `recompilation`, carries the counts, the rate and the cause with the user's file and
line. Everything here runs on the sidecar thread; the training thread never waits for it.

Its figures are its own (`CompileFigures`, one per series): `hbmwatch_xla_compilations_total`,
`hbmwatch_recompilation_detected` and `hbmwatch_steps_per_recompilation`, absent off XLA.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator

from prometheus_client.core import Metric

from watchdog.core.compile_causes import SourceView, explain, parse_compile_analysis
from watchdog.core.recompilation import Recompilation, RecompilationConfig, RecompilationDetector
from watchdog.logs import get_logger
from watchdog.runtime import xla_stats
from watchdog.runtime.xla_stats import AnalysisReader, CompileAnalysis
from watchdog.station.exporter import counter_family, gauge_family
from watchdog.station.telemetry import Telemetry

log = get_logger(__name__)


class CompileFigures:
    """What the compile watch last saw, replaced whole by the sidecar thread; None: not watched."""

    def __init__(self, labels: Callable[[], list[str]]):
        self._labels = labels
        self.compilations: int | None = None  # XLA graphs compiled in this process
        self.detected: bool | None = None  # a recompilation finding is up
        self.steps_per_recompilation: float | None = None  # since warm-up; inf while none
        self.finding: dict | None = None  # the newest `recompilation` finding, as logged

    def collect(self) -> Iterator[Metric]:
        labels, detected = self._labels(), self.detected
        yield from counter_family("xla_compilations", "XLA graphs compiled in this process (absent off XLA).",
                                  labels, self.compilations)
        yield from gauge_family("recompilation_detected", "1 while XLA keeps compiling new graphs after warm-up (the "
                                "watchdog's `recompilation` finding, which names the cause), else 0; absent off XLA.",
                                labels, None if detected is None else float(detected))
        yield from gauge_family("steps_per_recompilation", "Training steps per XLA compilation since warm-up; +Inf "
                                "when none (absent off XLA).", labels, self.steps_per_recompilation)


@dataclass
class _Capture:
    found: Recompilation
    start_step: int
    start_compiles: int
    reader: AnalysisReader | None
    unavailable: str | None
    compile_seconds: float | None
    text: list[str] = field(default_factory=list)


class CompileWatch:
    def __init__(self, config: RecompilationConfig, telemetry: Telemetry, *,
                 analysis: CompileAnalysis | None = None, source: SourceView | None = None):
        self.config = config
        self.figures = telemetry.part(CompileFigures)
        self.detector = RecompilationDetector(config)
        self._analysis = analysis
        self._source = source
        self._capture: _Capture | None = None
        self._last: tuple[int, int] = (0, 0)
        self._warmup_seconds: float | None = None  # compile time by the end of warm-up

    def observe(self, step: int) -> None:
        """Call at each sample, after the step's sync."""
        compiles = xla_stats.compilations()
        figures = self.figures
        figures.compilations = compiles
        if compiles is None:
            return
        self._last = (step, compiles)
        was_active = self.detector.active
        found = self.detector.observe(step, compiles)
        if self.detector.warmup_end_step is None:
            self._warmup_seconds = None
        elif self._warmup_seconds is None:  # read twice per finding, not at every sample: it copies samples
            self._warmup_seconds = xla_stats.compile_seconds()
        figures.detected = self.detector.active is not None
        if was_active is not None and self.detector.active is None:
            log.info("recompilation_stopped", step=step, found_at_step=was_active.step, compilations=compiles)
        figures.steps_per_recompilation = self.detector.steps_per_compile
        if found is not None:
            now = xla_stats.compile_seconds()
            seconds = None if now is None or self._warmup_seconds is None else max(0.0, now - self._warmup_seconds)
            self._start_capture(found, step, compiles, seconds)
        if self._capture is not None:
            self._continue_capture(step, compiles)

    def close(self) -> None:
        """Report what an unfinished capture has (the run ended) and switch the capture off."""
        if self._capture is not None:
            self._report(self._capture, *self._last)

    def _start_capture(self, found: Recompilation, step: int, compiles: int, seconds: float | None) -> None:
        if self._capture is not None:  # a finding cleared and came back before its report: report it now
            self._report(self._capture, step, compiles)
        analysis = self._analysis or xla_stats.current_compile_analysis()
        reader = analysis.open() if self.config.explain else None
        unavailable = None if reader is not None else (
            analysis.why_not() if self.config.explain else "recompilation.explain is off")
        self._capture = _Capture(found, step, compiles, reader, unavailable, seconds)

    def _continue_capture(self, step: int, compiles: int) -> None:
        capture = self._capture
        assert capture is not None
        if capture.reader is None:
            self._report(capture, step, compiles)
            return
        capture.text.append(capture.reader.read())
        explained = len(parse_compile_analysis("".join(capture.text)))
        if explained >= self.config.capture_compiles or step - capture.start_step >= self.config.capture_steps:
            self._report(capture, step, compiles)

    def _report(self, capture: _Capture, step: int, compiles: int) -> None:
        self._capture = None
        if capture.reader is not None:
            capture.text.append(capture.reader.close())
        records = parse_compile_analysis("".join(capture.text))
        found = capture.found
        source = self._source or xla_stats.source_view()
        cause = explain(found, records, compiles_in_window=compiles - capture.start_compiles,
                        window_steps=step - capture.start_step, unavailable=capture.unavailable, source=source)
        finding = {
            "step": found.step, "trigger": found.trigger, "warmup_compiles": found.warmup_compiles,
            "compiles_after_warmup": found.compiles_after_warmup, "steps_after_warmup": found.steps_after_warmup,
            "steps_per_compile": round(found.steps_per_compile, 2), "every": found.every,
            "compile_seconds_after_warmup": (round(capture.compile_seconds, 3)
                                             if capture.compile_seconds is not None else None),
            "cached_graphs": xla_stats.cached_graphs(), "captured_steps": step - capture.start_step,
            "compiles_captured": compiles - capture.start_compiles, **cause.fields(),
        }
        finding["explanation"] = finding.pop("message")
        self.figures.finding = finding
        log.warning("recompilation", **finding)
