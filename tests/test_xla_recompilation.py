"""Steady-state recompilation on real torch_xla (PJRT CPU): found, its cause and line named, or not found.

Each scenario is a script in a fresh process (torch_xla reads its compile-analysis setting once
per process, at its first graph), written to a file so that Python frames name real lines:

(a) the seed's case under real Lightning and the `HbmWatchdogCallback`: `self.log` of a value read
    with `.item()` in `training_step`, before the step's sync, from a graph that grows every step;
    and the fix (log the detached tensor, Lightning reads it after the sync) with no finding;
(b) a plain torch_xla loop reading a running loss mid-graph every step;
(c) `hbm-watchdog train --inject-leak recompile:K`: a shape changing every K steps;
(d) bucketed shapes that stop compiling after warm-up: no finding;
and a watchdog created after the first graph: found, with what the runtime can and cannot say.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from conftest import json_lines, run_python_args

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
READ_MARKER = "# <- read before the sync"

PRELUDE = """
import json, sys
import torch, torch_xla
from watchdog import Watchdog, WatchdogConfig
from watchdog.core.recompilation import RecompilationConfig
from watchdog.logs import configure_logging
from watchdog.runtime.compile_watch import CompileFigures

configure_logging("json")
CONFIG = WatchdogConfig(sample_every=2, memory_limit_bytes=64 << 30,
                        recompilation=RecompilationConfig(warmup_steps=20))


def report(telemetry, extra=None):
    figures = telemetry.part(CompileFigures)
    print(json.dumps({"finding": figures.finding, "detected": figures.detected,
                      "steps_per_recompilation": figures.steps_per_recompilation,
                      "compilations": figures.compilations, **(extra or {})}))
"""

LIGHTNING = PRELUDE + f"""
import lightning as L
import torch_xla.runtime as xr
from lightning.fabric.accelerators.xla import XLAAccelerator
from torch.utils.data import DataLoader, TensorDataset
from watchdog.integrations.lightning import HbmWatchdogCallback

# Lightning asks the TPU metadata server how many devices there are; on PJRT CPU, PJRT knows.
XLAAccelerator.auto_device_count = staticmethod(xr.global_runtime_device_count)
XLAAccelerator.is_available = staticmethod(lambda: xr.global_runtime_device_count() > 0)
fixed = sys.argv[1] == "fixed"


class Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(16, 1)
        self.losses = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        if fixed:
            self.log("running_loss", loss.detach(), on_step=False, on_epoch=True, prog_bar=True)
        else:
            self.losses.append(loss.detach())
            self.log("running_loss", torch.stack(self.losses).mean().item(), prog_bar=True)  {READ_MARKER}
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


torch.manual_seed(0)
data = TensorDataset(torch.randn(640, 16), torch.randn(640, 1))
callback = HbmWatchdogCallback(CONFIG, checkpoint_dir=sys.argv[2])
trainer = L.Trainer(max_steps=50, accelerator="tpu", devices=1, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, callbacks=[callback])
trainer.fit(Regression(), DataLoader(data, batch_size=8))
report(callback.watchdog.telemetry, {{"exit_code": callback.exit_code, "steps": trainer.global_step}})
"""

PLAIN = PRELUDE + f"""
device = torch_xla.device()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(16, 32).to(device), torch.randn(16, 1).to(device)
losses = []
with Watchdog(CONFIG) as wd:
    for step in range(50):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        losses.append(loss.detach())
        print(f"running loss {{(sum(losses) / len(losses)).item():.4f}}", file=sys.stderr)  {READ_MARKER}
        opt.step()
        torch_xla.sync()
        wd.step(step)
    wd.drain()
report(wd.telemetry)
"""

BUCKETED = PRELUDE + """
device = torch_xla.device()
torch.manual_seed(0)
model = torch.nn.Linear(32, 1).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
BUCKETS = (8, 16, 32)  # variable batch sizes padded up to a fixed set: one graph per bucket
with Watchdog(CONFIG) as wd:
    for step in range(120):
        rows = BUCKETS[(step * 7) % len(BUCKETS)]
        x, y = torch.randn(rows, 32).to(device), torch.randn(rows, 1).to(device)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        torch_xla.sync()
        if step % 10 == 0:
            print(f"loss {loss.item():.4f}", file=sys.stderr)  # read after the sync: materialised already
        wd.step(step)
    wd.drain()
report(wd.telemetry)
"""

TOO_LATE = PRELUDE + """
device = torch_xla.device()
warm = torch.ones(4, device=device).sum()
torch_xla.sync()  # a graph runs before any watchdog exists: torch_xla has read its settings
with Watchdog(CONFIG) as wd:
    for step in range(40):
        probe = torch.ones(step + 1, device=device).sum()  # a new shape every step
        torch_xla.sync()
        wd.step(step)
    wd.drain()
report(wd.telemetry)
"""


def run_scenario(tmp_path: Path, source: str, *args: str) -> tuple[dict, list[dict], Path]:
    script = tmp_path / "scenario.py"
    script.write_text(textwrap.dedent(source))
    out = run_python_args([str(script), *args], timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1]), json_lines(out.stderr), script


def marked_line(script: Path) -> int:
    [line] = [n for n, text in enumerate(script.read_text().splitlines(), 1) if READ_MARKER in text]
    return line


def the_warning(records: list[dict]) -> dict:
    [event] = [r for r in records if r.get("event") == "recompilation"]
    assert event["level"] == "warning"
    return event


def test_lightning_self_log_of_a_value_read_before_the_sync_is_named_with_its_line(tmp_path):
    result, records, script = run_scenario(tmp_path, LIGHTNING, "read", str(tmp_path / "ckpt"))
    assert result["exit_code"] == 0 and result["steps"] == 50, "a finding never stops training"
    finding = the_warning(records)
    assert {key: finding[key] for key in result["finding"]} == result["finding"]  # logged as kept
    assert finding["cause"] == "value_read"
    assert (finding["file"], finding["line"]) == (str(script), marked_line(script))
    assert finding["code"] == 'self.log("running_loss", torch.stack(self.losses).mean().item(), prog_bar=True)'
    assert finding["explanation"].startswith(f"graph recompiled every step: `{finding['code']}` at ")
    assert f"scenario.py:{finding['line']} reads a tensor before torch_xla.sync()" in finding["explanation"]
    assert "handed to self.log(): pass the tensor itself, detached" in finding["explanation"]
    assert finding["every"] == "every step" and finding["steps_per_compile"] <= 1.5
    assert result["detected"] is True


def test_lightning_logging_the_detached_tensor_read_after_the_sync_has_no_finding(tmp_path):
    result, records, _ = run_scenario(tmp_path, LIGHTNING, "fixed", str(tmp_path / "ckpt"))
    assert result["steps"] == 50
    assert result["compilations"] > 0, "the probe must see compilations at all"
    assert result["finding"] is None and not [r for r in records if r.get("event") == "recompilation"]
    assert result["detected"] is False  # (fit's end compiles the epoch's mean: one graph, not a finding)


def test_a_plain_loop_reading_a_running_loss_mid_graph_is_named_with_its_line(tmp_path):
    result, records, script = run_scenario(tmp_path, PLAIN)
    finding = the_warning(records)
    assert finding["cause"] == "value_read"
    assert (finding["file"], finding["line"]) == (str(script), marked_line(script))
    assert ".item()" in finding["code"]
    assert "reads a tensor before torch_xla.sync()" in finding["explanation"]
    assert "has a different number of inputs each time" in finding["explanation"]  # the list grows
    assert finding["compiles_explained"] >= 3 and finding["distinct_graphs"] >= 3
    assert finding["compile_seconds_after_warmup"] > 0


def test_bucketed_shapes_that_stop_compiling_after_warm_up_have_no_finding(tmp_path):
    result, records, _ = run_scenario(tmp_path, BUCKETED)
    assert result["compilations"] >= 3, "one graph per bucket at least, during warm-up"
    assert result["finding"] is None and not [r for r in records if r.get("event") == "recompilation"]
    assert result["detected"] is False and result["steps_per_recompilation"] == float("inf")


def test_a_watchdog_created_after_the_first_graph_says_what_it_can_and_why_not_the_line(tmp_path):
    result, records, _ = run_scenario(tmp_path, TOO_LATE)
    finding = the_warning(records)
    assert finding["cause"] == "unknown" and finding["file"] is None and finding["line"] is None
    assert finding["explanation"].startswith("XLA compiles a new graph every step after warm-up")
    assert "before the watchdog was created" in finding["explanation"]
    assert finding["compiles_after_warmup"] >= 3


def test_the_trainers_recompile_leak_is_named_at_the_steps_sync(run_cli):
    out = run_cli("train", "--device", "xla", "--steps", "135", "--inject-leak", "recompile:5@100",
                  "--sample-every", "5", "--depth", "1", "--width", "16", "--heads", "1", "--seq-len", "8",
                  "--batch-size", "2", "--activation-checkpointing", "none", timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    finding = the_warning(json_lines(out.stderr))
    loop = REPO / "watchdog" / "trainer" / "loop.py"
    [sync_line] = [n for n, text in enumerate(loop.read_text().splitlines(), 1)
                   if "self._sync()  # XLA: the step's graph runs here" in text]
    assert finding["cause"] == "graph_changes"
    assert (finding["file"], finding["line"], finding["code"]) == (str(loop), sync_line, "self._sync()")
    assert finding["every"] == "every ~5 steps"
    assert finding["explanation"].startswith("the step's graph changes every ~5 steps: each new graph is compiled "
                                             "at `self._sync()` at watchdog/trainer/loop.py:")
    assert "not the op or shape that changed" in finding["explanation"]
    assert finding["step"] >= 100, "the shape starts changing at step 100, after warm-up"
