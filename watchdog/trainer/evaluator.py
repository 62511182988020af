"""The trainer's evaluation: `eval_steps` held-out batches every `eval_every` steps, under the
watchdog's "eval" phase.

With `eval_keep_outputs` each batch's logits stay on the device until the evaluation ends (the
"predictions accumulated on the device" pattern): memory climbs through the evaluation and falls
back after it. An action the watchdog asks for meanwhile ends the evaluation early and is
returned, to be carried out between steps. An evaluation reads the model and draws nothing from
the RNG, so it changes no training step.
"""

from __future__ import annotations

from typing import Callable

import torch

from watchdog.core.verdict import Action
from watchdog.logs import get_logger

log = get_logger(__name__)

EVAL_POSITION = 1 << 40  # held out: the same batches every evaluation, at positions no training step reaches


def eval_step(model, tokens: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        logits, loss = model(tokens, targets)
    return logits, loss


class Evaluator:
    def __init__(self, config, data, to_device: Callable, sync: Callable[[], None], first_watch_step: Callable[[int], int]):
        self.config, self.data, self.to_device, self.sync = config, data, to_device, sync
        self._first_watch_step = first_watch_step  # the watchdog's counter for the batch after training step `step`
        self.losses: dict[int, float] = {}

    def due(self, step: int) -> bool:
        return bool(self.config.eval_every) and (step + 1) % self.config.eval_every == 0

    def run(self, model, step: int, watchdog) -> Action | None:
        """Evaluate `model` after training step `step`; the action the watchdog asked for meanwhile, if any."""
        config = self.config
        first = self._first_watch_step(step)
        kept: list[torch.Tensor] = []
        losses: list[torch.Tensor] = []
        action = None
        model.eval()
        try:
            with watchdog.phase("eval", steps=config.eval_steps):
                for index in range(config.eval_steps):
                    logits, loss = eval_step(model, *self.to_device(self.data.batch_at(EVAL_POSITION + index)))
                    losses.append(loss)
                    if config.eval_keep_outputs:
                        kept.append(logits)
                    del logits
                    self.sync()
                    action = watchdog.step(first + index)
                    if action is not None:
                        log.warning("evaluation_stopped", step=step, batches=index + 1, action=action.value)
                        break
        finally:
            model.train()
        kept_bytes = sum(t.numel() * t.element_size() for t in kept)
        del kept
        value = float(torch.stack(losses).mean().item())  # one read per evaluation, after its last sync
        self.losses[step] = value
        log.info("evaluated", step=step, loss=round(value, 4), batches=len(losses), kept_output_bytes=kept_bytes)
        return action
