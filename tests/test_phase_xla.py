"""A first evaluation that keeps its outputs on the device, in a real torch_xla loop on PJRT CPU with
the public Watchdog API and resident memory as the source: without phase information it gets no
checkpoint (a WARN at most); with `wd.phase("eval", steps=...)` it gets nothing at all, even with
a budget so tight that the same climb without phase information is imminent and acted on."""

from __future__ import annotations

import json

import pytest
from conftest import run_python

from watchdog.core.sample import load_trace

LOOP = r"""
import json, sys
import torch, torch_xla
from watchdog import Action, Watchdog, WatchdogConfig
from watchdog.core.policy import PolicyConfig
from watchdog.readers.sources import RssSource

use_phase, trace, spare_share = sys.argv[1] == "phase", sys.argv[2], float(sys.argv[3])
CHECKPOINT_MARGIN = int(sys.argv[4])
TRAIN_BEFORE, EVAL, TRAIN_AFTER = 1000, 300, 300
device = torch_xla.device()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 160 * 128)).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
x = torch.randn(8, 64).to(device)

def train_step():
    optimizer.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    optimizer.step()
    torch_xla.sync()

for _ in range(30):  # compile, and let the allocator settle, before the budget is measured
    train_step()
kept = EVAL * 8 * 160 * 128 * 4  # 640 KiB of predictions a batch: 188 MiB by the end
limit = int((RssSource().read().bytes_used + kept + (8 << 20)) / (1 - spare_share))
config = WatchdogConfig(sample_every=5, source="rss", memory_limit_bytes=limit, trace_file=trace,
                        policy=PolicyConfig(checkpoint_margin_steps=CHECKPOINT_MARGIN))
checkpoints, counter = [], 0
with Watchdog(config) as wd:
    def step():
        global counter
        if wd.step(counter) is not None:
            checkpoints.append(counter)
        counter += 1

    for _ in range(TRAIN_BEFORE):
        train_step(); step()
    predictions = []
    phase = wd.phase("eval", steps=EVAL) if use_phase else None
    with torch.no_grad():
        for _ in range(EVAL):
            predictions.append(model(x))  # kept on the device until the evaluation ends
            torch_xla.sync(); step()
    if phase is not None:
        phase.end()
    del predictions
    for _ in range(TRAIN_AFTER):
        train_step(); step()
    wd.drain()
    warnings = wd.telemetry.actions_snapshot()[Action.WARN]
print(json.dumps({"checkpoints": checkpoints, "warnings": warnings}))
"""


def evaluate_once(tmp_path, mode: str, spare_share: float, checkpoint_margin_steps: int = 50) -> dict:
    trace = tmp_path / f"{mode}.csv"
    out = json.loads(run_python(LOOP, mode, str(trace), str(spare_share), str(checkpoint_margin_steps),
                                timeout=600).strip().splitlines()[-1])
    samples = load_trace(trace)
    during = [s.bytes_used for s in samples if 1000 <= s.step < 1300]
    assert max(during) - min(during) > 100 << 20  # the evaluation's outputs really were held: RSS climbed
    out["phases"] = {s.phase for s in samples}
    return out


@pytest.mark.slow
def test_a_first_evaluation_without_phase_information_gets_no_checkpoint(tmp_path):
    """The climb is not imminent (four checkpoint margins: 105 steps here) but inside the usual
    horizon (a quarter of the ~1,280 steps watched): only the caution for a first ramp holds the
    checkpoint back. The climb's pessimistic projection lands near 190-380 steps from run to run
    (resident memory grows a little faster or slower); with a 50-step margin the imminent bound was
    205 steps, and one run in CI at 172 was rightly acted on as imminent."""
    # 16% of the budget above the peak: about 140 MiB, the climb's projection some 230 steps out (its
    # pessimistic edge less): past the imminent bound even when the suite's load widens the gaps between
    # readings, inside the horizon. (8% was the share when the budget was sized from the resident set,
    # about 1.2 GB with the libraries' pages; the job's memory, each page once, is about 0.55 GiB.)
    out = evaluate_once(tmp_path, "plain", 0.16, checkpoint_margin_steps=25)
    assert out["checkpoints"] == [], out
    assert out["phases"] == {""}


@pytest.mark.slow
def test_with_the_phase_api_the_same_evaluation_gets_nothing_even_where_it_would_be_imminent(tmp_path):
    out = evaluate_once(tmp_path, "phase", 0.04)
    assert out["checkpoints"] == [] and out["warnings"] == 0, out
    assert out["phases"] == {"", "eval/300"}
