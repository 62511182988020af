"""The data-parallel path (torch_xla.launch replicas: MpDeviceLoader, xm.optimizer_step, rank-0 saves).

PJRT CPU cannot run collectives between two devices (pytorch/xla#5005), so two replicas cannot
train here; what can be checked here is that the replicated machinery with one replica trains
exactly like the plain loop, through a reinit, and that two devices on PJRT CPU are refused clearly.
"""

import pytest
from conftest import run_python

from watchdog.commands.cli import main
from watchdog.core.errors import EXIT_BAD_INPUT

REPLICATED = r"""
import sys, torch, torch_xla
from pathlib import Path
from watchdog.trainer.loop import Replica, TrainConfig, Trainer
from watchdog.trainer.model import ModelConfig
from watchdog.core.verdict import Action

base = TrainConfig(steps=6, model=ModelConfig(depth=1, width=32, heads=2, seq_len=16), batch_size=2,
                   device="xla", log_every=1, watchdog=None, progress_bar=False)
states, losses = [], []
for name, replica, forced in (("plain", Replica(), ()),
                              ("replicated", Replica(0, 1, replicated=True), ((2, Action.CHECKPOINT_REINIT),))):
    config = TrainConfig(**{**base.__dict__, "checkpoint_dir": Path(sys.argv[1], name), "forced_actions": forced})
    trainer = Trainer(config, replica=replica)
    result = trainer.run()
    assert result.step == 6 and result.reinits == len(forced), result
    states.append({k: v.cpu() for k, v in trainer.state.model.state_dict().items()})
    losses.append(result.losses)
    trainer.close()
assert losses[0] == losses[1], losses
for key in states[0]:
    assert torch.equal(states[0][key], states[1][key]), key
print("ok")
"""


@pytest.mark.slow
def test_replicated_machinery_trains_exactly_like_the_plain_loop(tmp_path):
    assert run_python(REPLICATED, str(tmp_path)).strip().endswith("ok")


def test_two_devices_on_pjrt_cpu_are_refused_with_a_reason(monkeypatch, capsys):
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    assert main(["train", "--num-devices", "2", "--steps", "1"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "PJRT CPU has no cross-device collectives" in err and err.count("\n") == 1
