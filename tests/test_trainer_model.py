"""The model, its activation checkpointing, the activation probe, and the data stream."""

from dataclasses import replace

import pytest
import torch
from conftest import run_python

from watchdog.core.errors import ConfigError, InputError
from watchdog.trainer.data import TokenSource
from watchdog.trainer.model import ModelConfig, TransformerLM
from watchdog.trainer.probe import probe

SMALL = ModelConfig(depth=2, width=32, heads=4, seq_len=16, vocab_size=64)


def loss_and_grads(config, batch):
    torch.manual_seed(0)
    model = TransformerLM(config).train()
    logits, loss = model(batch.tokens, batch.targets)
    loss.backward()
    return logits, loss, {name: p.grad.clone() for name, p in model.named_parameters()}


def test_forward_shapes_and_checkpointing_changes_nothing_but_memory():
    batch = TokenSource(batch_size=3, seq_len=16, vocab_size=64, seed=1).batch_at(0)
    assert batch.tokens.shape == batch.targets.shape == (3, 16)
    logits, loss, grads = loss_and_grads(SMALL, batch)
    logits_ckpt, loss_ckpt, grads_ckpt = loss_and_grads(replace(SMALL, activation_checkpointing="full"), batch)
    assert logits.shape == logits_ckpt.shape == (3, 16, 64)
    assert torch.equal(loss, loss_ckpt)  # the forward is the same computation
    for name in grads:
        torch.testing.assert_close(grads_ckpt[name], grads[name], rtol=1e-5, atol=1e-7)
    assert 3.5 < loss.item() < 4.8  # ~ln(64) at initialisation: the model is not trivially broken


@pytest.mark.parametrize("field, value", [("width", 30), ("heads", 0), ("dropout", 1.0),
                                          ("activation_checkpointing", "some")])
def test_bad_model_config_names_the_field(field, value):
    with pytest.raises(ConfigError) as info:
        replace(ModelConfig(), **{field: value})
    assert info.value.field == field


def test_probe_counts_fewer_saved_bytes_with_checkpointing():
    found = probe(ModelConfig(), batch_size=8)
    deeper = probe(ModelConfig(depth=4), batch_size=8)
    assert found.with_checkpointing < found.without_checkpointing / 3
    # Without checkpointing every block adds its activations; with it, only its input.
    per_block = (deeper.without_checkpointing - found.without_checkpointing) / 2
    per_block_ckpt = (deeper.with_checkpointing - found.with_checkpointing) / 2
    assert per_block_ckpt == 8 * 64 * 64 * 4  # one (batch, seq, width) float32 input per block
    assert per_block > 10 * per_block_ckpt


def test_batches_are_a_pure_function_of_position_and_shard():
    source = TokenSource(batch_size=4, seq_len=32, vocab_size=256, seed=3)
    again = TokenSource(batch_size=4, seq_len=32, vocab_size=256, seed=3)
    assert torch.equal(source.batch_at(17).tokens, again.batch_at(17).tokens)
    assert not torch.equal(source.batch_at(17).tokens, source.batch_at(18).tokens)
    first, second = (TokenSource(batch_size=4, seq_len=32, vocab_size=256, seed=3, shard=s, num_shards=2)
                     for s in (0, 1))
    assert not torch.equal(first.batch_at(0).tokens, second.batch_at(0).tokens)
    batch = source.batch_at(5)
    assert torch.equal(batch.tokens[:, 1:], batch.targets[:, :-1])  # targets are the next token
    follows = (source.chain[batch.tokens] == batch.targets).float().mean().item()
    assert follows > 0.8  # learnable: the chain is followed most of the time


def test_text_file_batches_are_windows_of_the_file(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("hello watchdog " * 50)
    batch = TokenSource(batch_size=2, seq_len=10, vocab_size=256, seed=0, text_file=text).batch_at(0)
    for row in batch.tokens:
        assert bytes(row.tolist()).decode() in text.read_text()
    short = tmp_path / "short.txt"
    short.write_text("abc")
    with pytest.raises(InputError, match="needs at least"):
        TokenSource(batch_size=2, seq_len=10, vocab_size=256, seed=0, text_file=short)


XLA_CHECKPOINT = r"""
import torch, torch_xla
from dataclasses import replace
from watchdog.trainer.data import TokenSource
from watchdog.trainer.model import ModelConfig, TransformerLM, checkpoint_function
import torch_xla.utils.checkpoint as xla_ckpt
assert checkpoint_function("xla") is xla_ckpt.checkpoint
device = torch_xla.device()
config = ModelConfig(depth=2, width=32, heads=4, seq_len=16, vocab_size=64)
batch = TokenSource(batch_size=2, seq_len=16, vocab_size=64, seed=0).batch_at(0)
results = []
for mode in ("none", "full"):
    torch.manual_seed(0)
    model = TransformerLM(replace(config, activation_checkpointing=mode)).to(device)
    _, loss = model(batch.tokens.to(device), batch.targets.to(device))
    loss.backward()
    torch_xla.sync()
    results.append((loss.item(), model.head.weight.grad.cpu()))
(loss_a, grad_a), (loss_b, grad_b) = results
assert abs(loss_a - loss_b) < 1e-6, (loss_a, loss_b)
torch.testing.assert_close(grad_a, grad_b, rtol=1e-4, atol=1e-6)
print("ok", loss_a)
"""


@pytest.mark.slow
def test_xla_checkpointing_uses_torch_xla_and_gives_the_same_loss():
    assert run_python(XLA_CHECKPOINT).startswith("ok")
