"""Atomic checkpoints that survive being killed mid-write, and the RNG state that makes resumes exact.

Why atomic: the watchdog checkpoints *because* the process is about to die (an OOM is coming,
the node is being preempted). A checkpoint torn by that death must never replace the last good
one. So a save writes a temporary file in the same directory, flushes and fsyncs it, renames it
over the final name (atomic on POSIX) and fsyncs the directory so the rename itself is durable.
A reader only ever sees complete files under the `ckpt-XXXXXXXX.pt` name; temporaries start with a
dot, are never listed, and are removed by the next save.

Why `weights_only=True`: a checkpoint directory is often shared storage; loading must not run
arbitrary pickled code. Everything saved therefore has to be tensors and plain Python values,
which is why the RNG helpers below convert python's and numpy's generator states to tensors.

One writer per directory (rank 0 in a multi-rank job): a save removes every stale temporary.
"""

from __future__ import annotations

import os
import random
import re
from pathlib import Path
from typing import Any

from watchdog.core.errors import ConfigError, InputError
from watchdog.logs import get_logger

log = get_logger(__name__)

_CHECKPOINT_NAME = re.compile(r"^ckpt-(\d{8,})\.pt$")
_TEMP_PREFIX = ".ckpt-"
_TEMP_SUFFIX = ".tmp"


def checkpoint_name(step: int) -> str:
    return f"ckpt-{step:08d}.pt"


def step_of(path: Path) -> int | None:
    """The step a checkpoint file name encodes, or None if the name is not a checkpoint's."""
    match = _CHECKPOINT_NAME.match(path.name)
    return int(match.group(1)) if match else None


class CheckpointManager:
    """Saves `ckpt-{step:08d}.pt` atomically in `directory`, keeps the newest `keep_last`, loads the newest good one."""

    def __init__(self, directory: str | os.PathLike, keep_last: int = 3):
        if keep_last < 1:
            raise ConfigError("keep_last", f"must be at least 1, got {keep_last}")
        self.directory = Path(directory)
        self.keep_last = keep_last
        _ensure_writable_directory(self.directory)

    def list(self) -> list[Path]:
        """Checkpoint files, oldest step first. Temporaries and foreign files are not listed."""
        found = [(step, path) for path in self.directory.iterdir() if (step := step_of(path)) is not None]
        return [path for _, path in sorted(found)]

    def latest_step(self) -> int | None:
        """The newest step on disk, from the file names (load_latest is what proves a file readable)."""
        files = self.list()
        return step_of(files[-1]) if files else None

    def save(self, state: dict, step: int) -> Path:
        """Write `state` for `step` atomically, then prune to the newest `keep_last`. Returns the final path.

        Checkpoints of later steps than `step` are removed (see `_prune`).

        Tensors are moved to CPU first, so a checkpoint taken on XLA or CUDA loads anywhere.
        """
        import torch

        if step < 0:
            raise InputError(f"checkpoint step must be >= 0, got {step}")
        self._remove_stale_temporaries()
        final = self.directory / checkpoint_name(step)
        temp = self.directory / f"{_TEMP_PREFIX}{step:08d}.{os.getpid()}{_TEMP_SUFFIX}"
        try:
            with open(temp, "xb") as handle:
                torch.save(tensors_to_cpu(state), handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temp, final)
        except BaseException:
            temp.unlink(missing_ok=True)  # a failed save (disk full, interrupt) leaves no debris
            raise
        _fsync_directory(self.directory)
        self._prune(step)
        log.info("checkpoint_saved", path=str(final), step=step, bytes=final.stat().st_size)
        return final

    def load_latest(self, map_location: Any = "cpu") -> dict | None:
        """The newest checkpoint that loads, or None when there is none.

        A torn, corrupt or unsafe (needs arbitrary unpickling) file is skipped with a warning naming
        the file and the reason, and the one before it is tried.
        """
        import torch

        for path in reversed(self.list()):
            try:
                state = torch.load(path, map_location=map_location, weights_only=True)
            except Exception as exc:  # any failure to read means "not usable", never "crash the resume"
                log.warning("checkpoint_skipped", path=str(path), reason=_one_line(exc))
                continue
            if not isinstance(state, dict):
                log.warning("checkpoint_skipped", path=str(path),
                            reason=f"holds a {type(state).__name__}, not a dict")
                continue
            log.info("checkpoint_loaded", path=str(path), step=step_of(path))
            return state
        return None

    def _prune(self, saved_step: int) -> None:
        """Keep the newest `keep_last` up to `saved_step`; drop any beyond it.

        A file with a later step than the one just saved belongs to an abandoned timeline (it was
        unreadable at resume, or the run started over with `--resume never`); left there, the next
        resume would jump into it.
        """
        files = self.list()
        later = [path for path in files if step_of(path) > saved_step]
        for path in later:
            log.warning("checkpoint_superseded", path=str(path), saved_step=saved_step)
            path.unlink(missing_ok=True)
        kept = [path for path in files if step_of(path) <= saved_step]
        for path in kept[:-self.keep_last]:
            path.unlink(missing_ok=True)

    def _remove_stale_temporaries(self) -> None:
        """Temporaries left by a writer that died mid-save (SIGKILL, OOM killer, power loss)."""
        for path in self.directory.glob(f"{_TEMP_PREFIX}*{_TEMP_SUFFIX}"):
            log.info("checkpoint_stale_temporary_removed", path=str(path))
            path.unlink(missing_ok=True)


def _ensure_writable_directory(directory: Path) -> None:
    """Create the directory and prove it writable now, not at the first save an hour into training."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f"{_TEMP_PREFIX}probe.{os.getpid()}{_TEMP_SUFFIX}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise InputError(f"checkpoint directory {directory} is not writable: "
                         f"{exc.strerror or type(exc).__name__}") from None


def _fsync_directory(directory: Path) -> None:
    """Make the rename durable; some filesystems cannot fsync a directory, which is not an error."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def tensors_to_cpu(value: Any) -> Any:
    """The same nested dict/list/tuple structure with every tensor detached and on CPU."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return type(value)((key, tensors_to_cpu(item)) for key, item in value.items())
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(tensors_to_cpu(item) for item in value)
    return value


# --- RNG state: every generator a training step draws from, in weights_only-safe form ---------------

def capture_rng_state(device: Any = None) -> dict:
    """Python, numpy and torch CPU generator states, plus the device's (XLA seed or CUDA state).

    Python's state is a tuple of 625 ints and numpy's holds an ndarray; both become int64 tensors
    so the checkpoint loads with `weights_only=True`.
    """
    import numpy as np
    import torch

    version, internal, gauss_next = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_cached_gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": {"version": version, "internal": torch.tensor(internal, dtype=torch.int64),
                   "gauss_next": gauss_next},
        "numpy": {"kind": str(np_kind), "keys": torch.from_numpy(np_keys.astype(np.int64)),
                  "pos": int(np_pos), "has_gauss": int(np_has_gauss), "cached_gauss": float(np_cached_gauss)},
        "torch": torch.get_rng_state(),
    }
    device_type = _device_type(device)
    if device_type == "xla":
        import torch_xla.core.xla_model as xm

        state["xla"] = int(xm.get_rng_state(str(device)))
    elif device_type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng_state(state: dict, device: Any = None) -> None:
    """Put back what `capture_rng_state` took; a device state is restored only for that device type."""
    import numpy as np
    import torch

    python = state["python"]
    random.setstate((int(python["version"]), tuple(int(v) for v in python["internal"].tolist()),
                     python["gauss_next"]))
    numpy = state["numpy"]
    np.random.set_state((numpy["kind"], numpy["keys"].numpy().astype(np.uint32), int(numpy["pos"]),
                         int(numpy["has_gauss"]), float(numpy["cached_gauss"])))
    torch.set_rng_state(state["torch"].cpu())
    device_type = _device_type(device)
    if device_type == "xla" and "xla" in state:
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(int(state["xla"]), str(device))
    elif device_type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


def _device_type(device: Any) -> str | None:
    if device is None:
        return None
    import torch

    return torch.device(device).type
