"""Draw the README pictures from the corpus: `python -m watchdog.bench.make_pictures [OUT_DIR]`.

One leaking trace (the watchdog acts before the marked true OOM) and one clean hard negative
(a level shift it must not mistake for a leak), through the same `report` code users run.
"""

from __future__ import annotations

import sys
from pathlib import Path

from watchdog.bench.corpus import synthetic_corpus
from watchdog.commands.report import draw_trace

LEAK_TRACE = "late_onset_leak-03"
CLEAN_TRACE = "eval_buffers_kept-02"
DEFAULT_DIR = Path(__file__).resolve().parents[2] / "deploy" / "img"


def make_pictures(out_dir: str | Path = DEFAULT_DIR, leak: str = LEAK_TRACE, clean: str = CLEAN_TRACE,
                  seed: int = 0) -> list[Path]:
    traces = {t.name: t for t in synthetic_corpus(seed)}
    written = []
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    for name, file_name in ((leak, "report_leak.png"), (clean, "report_clean.png")):
        trace = traces[name]
        written.append(draw_trace(trace.samples, Path(out_dir) / file_name,
                                     name=f"{trace.name} ({trace.description})",
                                     memory_limit_bytes=trace.limit_bytes, true_oom_step=trace.oom_step))
    return written


if __name__ == "__main__":
    for path in make_pictures(*sys.argv[1:2]):
        print(f"wrote {path}")
