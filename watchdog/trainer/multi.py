"""Several devices: one trainer replica per device through `torch_xla.launch`.

Each replica reads its own shard of the data through `MpDeviceLoader`, all-reduces gradients in
`xm.optimizer_step`, and runs its own watchdog (rank = its ordinal, metrics on port + rank).
Replicas agree on actions on sampling steps through their watchdogs (`actions/agreement.py`), over
torch.distributed: a gloo group is set up over torch_xla's `xla://` rendezvous when the launcher did
not make one. Rank 0 writes
checkpoints; the others wait for it at a rendezvous.

PJRT CPU has no cross-device collectives (pytorch/xla#5005: an all-reduce between two CPU
devices never meets), so more than one device there is refused up front with exit status 2.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path

from watchdog.core.errors import EXIT_OK, InputError
from watchdog.fileio import write_atomically
from watchdog.station.endpoint import DEFAULT_ADDRESS


def train_replicated(config, num_devices: int, *, metrics_port: int | None = None,
                     metrics_address: str = DEFAULT_ADDRESS) -> int:
    """Run `num_devices` replicas; print each one's summary; the most urgent exit status wins (42 > 0)."""
    from watchdog.trainer.loop import _has_tpu

    if config.device not in ("auto", "xla"):
        raise InputError("--num-devices above 1 needs --device xla (or auto)")
    platform = (os.environ.get("PJRT_DEVICE") or ("TPU" if _has_tpu() else "CPU")).upper()
    if platform == "CPU":
        raise InputError("--num-devices above 1 needs TPUs or GPUs under PJRT: PJRT CPU has no "
                         "cross-device collectives (pytorch/xla#5005); use --num-devices 1")
    os.environ["PJRT_DEVICE"] = platform
    os.environ.setdefault(f"{platform}_NUM_DEVICES", str(num_devices))
    import torch_xla

    with tempfile.TemporaryDirectory(prefix="hbm-watchdog-replicas-") as results:
        if config.checkpoint_dir is None:  # one directory all replicas share (rank 0 writes, all read)
            config = dataclasses.replace(config, checkpoint_dir=Path(results, "checkpoints"))
        torch_xla.launch(_replica, args=(config, metrics_port, metrics_address, results))
        outcomes = [json.loads(p.read_text()) for p in sorted(Path(results).glob("rank-*.json"))]
    if len(outcomes) != num_devices:
        raise InputError(f"--num-devices {num_devices}: the runtime launched {len(outcomes)} replicas "
                         f"(set {platform.upper()}_NUM_DEVICES or the visible devices to match)")
    for outcome in outcomes:
        print(f"rank {outcome['rank']}: {outcome['summary']}", flush=True)
    return max(outcome["exit_code"] for outcome in outcomes) or EXIT_OK


def _replica(index: int, config, metrics_port: int | None, metrics_address: str, results: str) -> None:
    import torch.distributed as dist
    import torch_xla.runtime as xr

    from watchdog.station.telemetry import Telemetry
    from watchdog.trainer.loop import Replica, Trainer

    replica = Replica(rank=xr.global_ordinal(), world=xr.world_size(), replicated=True)
    if replica.world > 1 and not dist.is_initialized():
        import torch_xla.distributed.xla_backend  # noqa: F401 - registers the xla:// rendezvous

        dist.init_process_group("gloo", init_method="xla://")
    telemetry = Telemetry(rank=replica.rank)
    server = None
    if metrics_port is not None and config.watchdog is not None:
        from watchdog.station.exporter import serve_metrics

        server = serve_metrics(telemetry, metrics_port, local_rank=xr.local_ordinal(), addr=metrics_address)
        print(f"metrics (rank {replica.rank}): {server.url}", flush=True)
    trainer = Trainer(config, telemetry=telemetry, replica=replica)
    try:
        result = trainer.run()
    finally:
        trainer.close()
        if server is not None:
            server.close()
    write_atomically(Path(results, f"rank-{replica.rank:05d}.json"),
                     json.dumps({"rank": replica.rank, "exit_code": result.exit_code, "summary": result.summary()}))
