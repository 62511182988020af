"""Draw the README pictures from the corpus: `python -m watchdog.bench.make_pictures [OUT_DIR]`.

One leaking trace (the watchdog acts before the marked true OOM) and one clean hard negative
(a level shift it must not mistake for a leak), through the same `report` code users run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from watchdog.bench.corpus import synthetic_corpus
from watchdog.commands.cli import OneLineParser
from watchdog.core.inputs import folder_to_write
from watchdog.core.numbers import option
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


def parser() -> argparse.ArgumentParser:
    made = OneLineParser(prog="python -m watchdog.bench.make_pictures", description=__doc__.splitlines()[0])
    made.add_argument("out_dir", nargs="?", type=option(folder_to_write), default=str(DEFAULT_DIR), metavar="OUT_DIR",
                      help="where the pictures go (default deploy/img)")
    return made


def main(argv: list[str] | None = None) -> int:
    for path in make_pictures(parser().parse_args(argv).out_dir):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
