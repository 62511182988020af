"""How many bytes of activations one training step keeps alive for backward, with and without
activation checkpointing: the benefit as a number, not a claim.

One forward pass on the CPU under `torch.autograd.graph.saved_tensors_hooks` sees every tensor
autograd saves for backward. Checkpointed blocks save nothing through those hooks, but they do
keep their inputs for the recompute, so a block's input counts too. Tensors are counted once per
storage (views share one), and parameters are not activations, so they are left out.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from watchdog.trainer.data import TokenSource
from watchdog.trainer.model import ModelConfig, TransformerLM


@dataclass(frozen=True)
class ActivationProbe:
    without_checkpointing: int
    with_checkpointing: int

    @property
    def ratio(self) -> float:
        return self.with_checkpointing / self.without_checkpointing


def saved_activation_bytes(config: ModelConfig, batch_size: int, seed: int = 0) -> int:
    """Bytes held for backward by one forward pass of `config` on a batch (CPU)."""
    torch.manual_seed(seed)
    model = TransformerLM(config).train()
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    batch = TokenSource(batch_size=batch_size, seq_len=config.seq_len, vocab_size=config.vocab_size,
                        seed=seed).batch_at(0)
    held: dict[int, int] = {}

    def remember(tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            held[storage.data_ptr()] = storage.nbytes()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        remember(tensor)
        return tensor

    hooks = []
    if config.activation_checkpointing == "full":
        hooks = [block.register_forward_pre_hook(lambda _module, args: remember(args[0]))
                 for block in model.blocks]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        _, loss = model(batch.tokens, batch.targets)
    for hook in hooks:
        hook.remove()
    loss.backward()  # the step completes: checkpointed blocks really do recompute
    return sum(held.values())


def probe(config: ModelConfig, batch_size: int, seed: int = 0) -> ActivationProbe:
    return ActivationProbe(
        without_checkpointing=saved_activation_bytes(replace(config, activation_checkpointing="none"),
                                                     batch_size, seed),
        with_checkpointing=saved_activation_bytes(replace(config, activation_checkpointing="full"),
                                                  batch_size, seed),
    )
