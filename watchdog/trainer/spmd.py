"""`train --spmd`: one program sharded over every device, FSDPv2-style, following torch_xla's SPMD guide.

    xr.use_spmd()                       one process drives all its devices (one process per host)
    mesh (devices, 1) axes (fsdp, model) over every device of the job
    batch      sharded on fsdp (the data axis): each device computes its slice of the batch
    parameters sharded on fsdp along their largest dimension (SpmdFullyShardedDataParallel);
               the optimizer state follows them (XLA propagates the sharding into AdamW's update)
    each step ends with torch_xla.sync(), as everywhere; the compiler inserts the all-gathers
    and reduce-scatters

FSDPv2 is torch_xla 2.9's `torch_xla.experimental.spmd_fully_sharded_data_parallel`: it marks
each parameter's sharding, shards the forward's output on the same axis, and puts an
optimisation barrier in backward. Activation checkpointing stays the model's own
(`torch_xla.utils.checkpoint` per block), which composes with it.

Memory: under SPMD `xm.get_memory_info` raises, so the watchdog reads every chip through libtpu's
runtime metrics (the `tpu` source) and decides on the fullest. On PJRT CPU the devices are
virtual (`CPU_NUM_DEVICES=4`) and live in host memory: the `rss` source stands in, and says so.

Injected leaks (`--inject-leak`) are sharded like the batch, so SIZE/step is what the job leaks,
not SIZE on each device.

Checkpoints are sharded (watchdog/actions/sharded_checkpoint.py): each process writes its own
shards, and a resume reads them into a freshly built sharded state, primed so the optimizer state
exists to be read into.

On a multi-host slice every host runs this same program; torch.distributed (gloo, from the
standard WORLD_SIZE / RANK / MASTER_ADDR / MASTER_PORT environment, which the JobSet manifest
sets from the JobSet's coordinator) carries the checkpoint coordination and the watchdog's
agreement, never tensors of the step. Every host builds the same global batch (a pure function
of the data position) and the runtime transfers only the shards of its own devices.
"""

from __future__ import annotations

import os
import warnings

import torch

from watchdog.actions.sharded_checkpoint import ShardedCheckpointManager
from watchdog.core.errors import InputError
from watchdog.logs import get_logger
from watchdog.trainer.checkpointer import checkpoint_payload
from watchdog.trainer.data import Batch
from watchdog.trainer.loop import (
    Replica,
    TrainConfig,
    TrainerState,
    _has_tpu,
    build_state,
    check_same_model,
    restore_state,
)

log = get_logger(__name__)

MESH_AXES = ("fsdp", "model")


class Spmd:
    """The `--spmd` strategy: where the state lives, how a batch gets there, how checkpoints are kept."""

    sharded_checkpoints = True

    def __init__(self):
        platform = os.environ.setdefault("PJRT_DEVICE", "TPU" if _has_tpu() else "CPU").upper()
        import numpy as np
        import torch_xla
        import torch_xla.distributed.spmd as xs
        import torch_xla.runtime as xr

        xr.use_spmd()  # before any tensor reaches the device
        _join_the_hosts(xr.process_count(), xr.process_index())
        self.num_devices = xr.global_runtime_device_count()
        self.mesh = xs.Mesh(np.arange(self.num_devices), (self.num_devices, 1), MESH_AXES)
        xs.set_global_mesh(self.mesh)
        self._batch_sharding = xs.ShardingSpec(self.mesh, ("fsdp", None))
        self.device = torch_xla.device()
        self.replica = Replica(rank=xr.process_index(), world=xr.process_count())
        log.info("spmd_mesh", platform=platform, devices=self.num_devices, mesh_shape=(self.num_devices, 1),
                 axes=MESH_AXES, processes=xr.process_count(), process=xr.process_index())
        if platform == "CPU" and self.num_devices == 1:
            log.warning("spmd_single_device", note="PJRT CPU shows one device; set CPU_NUM_DEVICES=4 "
                                                   "to shard over four virtual devices")

    # -- placement --

    def build_state(self, config: TrainConfig) -> TrainerState:
        """A fresh state with every parameter sharded on the fsdp axis (the optimizer follows)."""
        from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel

        state = build_state(config, self.device)
        # FSDPv2's backward barrier hook sees no input needing a gradient (ours are token ids): expected.
        warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed "
                                                  "with respect to module outputs", category=UserWarning)
        # The optimizer already holds these very parameters: wrapping marks their sharding in place.
        state.model = SpmdFullyShardedDataParallel(state.model, mesh=self.mesh, shard_output=_shard_logits)
        return state

    def to_device(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch, split on its first dimension across the fsdp axis as it is transferred."""
        import torch_xla.core.xla_model as xm

        tokens, targets = xm.send_cpu_data_to_device((batch.tokens, batch.targets), self.device,
                                                     input_sharding=self._batch_sharding)
        return tokens, targets

    def shard_new_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor the step creates (the injected leaks), split on its first dimension like the batch."""
        import torch_xla.distributed.spmd as xs

        xs.mark_sharding(tensor, self.mesh, ("fsdp",) + (None,) * (tensor.dim() - 1))
        return tensor

    # -- checkpoints --

    def checkpoint_manager(self, directory, keep_last: int) -> ShardedCheckpointManager:
        return ShardedCheckpointManager(directory, keep_last=keep_last)

    def open_run(self, checkpoints: ShardedCheckpointManager, config: TrainConfig, *, writer: bool = True
                 ) -> tuple[TrainerState, dict] | None:
        """At start: the same resume and "nothing lost" rules as a single file's (`Timeline`)."""
        return self._read(checkpoints, config, lambda into, check: checkpoints.open_run(
            into, resume=config.resume == "auto", overwrite=config.overwrite_checkpoints, check=check))

    def load_latest(self, checkpoints: ShardedCheckpointManager, config: TrainConfig
                    ) -> tuple[TrainerState, dict] | None:
        """The newest good checkpoint, read shard by shard into a fresh sharded state."""
        return self._read(checkpoints, config, lambda into, check: checkpoints.load_latest(into=into, check=check))

    def _read(self, checkpoints: ShardedCheckpointManager, config: TrainConfig, read) -> tuple[TrainerState, dict] | None:
        from torch_xla.experimental.distributed_checkpoint import prime_optimizer

        if checkpoints.latest_step() is None:
            return None
        state = self.build_state(config)
        prime_optimizer(state.optimizer)  # AdamW's state is created lazily: make it, to be read into
        template = checkpoint_payload(state, config, self.device, watchdog={}, reinits=0)
        payload = read(template, lambda saved: check_same_model(saved, config))
        if payload is None:
            return None
        return restore_state(payload, config, self.device, state=state), payload


def _shard_logits(output: tuple[torch.Tensor, torch.Tensor | None], mesh) -> None:
    """FSDPv2 shards the forward's output on the data axis; ours is (logits, loss): the logits."""
    import torch_xla.distributed.spmd as xs

    xs.mark_sharding(output[0], mesh, ("fsdp", None, None))


def _join_the_hosts(process_count: int, process_index: int) -> None:
    """Several hosts: a gloo group for checkpoint coordination and the watchdog's agreement.

    Its ranks must be the runtime's process indices: DCP's rank 0 writes the metadata, and the
    watchdog labels each host's metrics with it.
    """
    import torch.distributed as dist

    if process_count == 1 or dist.is_initialized():
        return
    expected = {"WORLD_SIZE": str(process_count), "RANK": str(process_index)}
    wrong = {name: os.environ.get(name) for name, value in expected.items() if os.environ.get(name) != value}
    if wrong or not os.environ.get("MASTER_ADDR"):
        raise InputError(f"--spmd on {process_count} hosts needs WORLD_SIZE={process_count}, "
                         f"RANK={process_index} (this host), MASTER_ADDR and MASTER_PORT for "
                         f"torch.distributed; got {wrong or 'no MASTER_ADDR'}")
    dist.init_process_group("gloo", init_method="env://")

