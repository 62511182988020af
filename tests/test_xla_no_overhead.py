"""The hard rule: the watchdog adds no XLA compilation and no device-to-host transfer.

The same small training loop runs on real torch_xla (PJRT CPU), each time in a fresh process so
the compile cache starts empty: bare; with a Watchdog sampling every step (recompilation
detection on, torch_xla's compile analysis on); and with the compile analysis also captured to a
file throughout, as after a recompilation finding. The compile and transfer counters of
`torch_xla.debug.metrics` must be identical.
"""

import json

import pytest
from conftest import run_python

LOOP = r"""
import json, os, sys
import torch, torch_xla
import torch_xla.debug.metrics as met
from watchdog import Watchdog, WatchdogConfig
from watchdog.core.compile_causes import parse_compile_analysis
from watchdog.runtime import xla_stats

with_watchdog = sys.argv[1] in ("on", "capture")
device = torch_xla.device()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(16, 32).to(device), torch.randn(16, 1).to(device)
torch_xla.sync()
met.clear_all()

wd = Watchdog(WatchdogConfig(sample_every=1, memory_limit_bytes=8 << 30)).start() if with_watchdog else None
capture = xla_stats.current_compile_analysis().open() if sys.argv[1] == "capture" else None
for step in range(30):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    torch_xla.sync()
    if wd is not None:
        assert wd.step(step) is None
        if step % 5 == 4:
            wd.drain()  # make sure samples really were taken while training ran
samples = 0
if wd is not None:
    wd.drain(); samples = wd.telemetry.samples_total; source = wd.source_name; wd.stop()
captured = len(parse_compile_analysis(capture.close())) if capture is not None else 0
final_loss = loss.item()  # the one deliberate transfer, in every run

counters = {name: met.counter_value(name) for name in met.counter_names()
            if "Compile" in name or "Transfer" in name or "ToCpu" in name or "_to_cpu" in name}
metrics = {name: met.metric_data(name)[0] for name in met.metric_names()
           if "Compile" in name or "Transfer" in name}
print(json.dumps({"counters": counters, "metrics": metrics, "samples": samples, "loss": final_loss,
                  "analysis_level": os.environ.get("PT_XLA_DEBUG_LEVEL"), "captured": captured}))
"""


def run(mode: str) -> dict:
    return json.loads(run_python(LOOP, mode).strip().splitlines()[-1])


@pytest.mark.slow
def test_watchdog_adds_no_compilation_and_no_transfer():
    bare, watched, captured = run("off"), run("on"), run("capture")
    assert watched["samples"] >= 6, "the watchdog must actually have sampled during the loop"
    assert bare["counters"].get("UncachedCompile", 0) > 0, "the probe must see compilations at all"
    assert "TransferFromDeviceTime" in bare["metrics"], "the probe must see the deliberate transfer"
    assert (bare["analysis_level"], watched["analysis_level"]) == (None, "1"), "detection on, analysis on"
    assert captured["captured"] == bare["counters"]["UncachedCompile"], "every compilation was captured"
    for run_with in (watched, captured):
        assert run_with["counters"] == bare["counters"]
        assert run_with["metrics"] == bare["metrics"]
        assert run_with["loss"] == bare["loss"]
