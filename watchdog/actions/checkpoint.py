"""Atomic checkpoints that survive being killed mid-write, and the RNG state that makes resumes exact.

Why atomic: the watchdog checkpoints *because* the process is about to die (an OOM is coming,
the node is being preempted). A checkpoint torn by that death must never replace the last good
one. So a save writes a temporary file in the same directory, flushes and fsyncs it, renames it
over the final name (atomic on POSIX) and fsyncs the directory so the rename itself is durable.
A reader only ever sees complete files under the `ckpt-XXXXXXXX.pt` name; temporaries
(`.ckpt-XXXXXXXX.<random>.tmp`, made by watchdog/fileio.py, so no planted link can stand in for
one) start with a dot, are never listed, and are removed by the next save.

Why `weights_only=True`: a checkpoint directory is often shared storage; loading must not run
arbitrary pickled code. Everything saved therefore has to be tensors and plain Python values,
which is why the RNG helpers below convert python's and numpy's generator states to tensors.

Why a checkpoint's name is not trusted alone: the name is the resume point and the pruning
order, but anything can sit under it, e.g. a symbolic link to another run's step 15 named
`ckpt-00000099.pt`, which would win every resume and push this run's real checkpoints out of
keep-last. So a checkpoint is trusted only when it is a regular file in the directory (not a
symbolic link, never opened through one: O_NOFOLLOW) and the step inside it agrees with the step
in its name; any other is skipped like a torn file, and is never one of this run's to prune.

Nothing lost: a run deletes only checkpoints of its own timeline, the ones it wrote and the ones
it resumed from (keep-last-k). `open_run` settles what is already in the directory before the
first step: continue it, or refuse to start over another run's checkpoints unless told to
replace them. A checkpoint that does not load is never deleted: when the run continues from an
older one, the unusable newer files are renamed aside (`*.unreadable`), out of its timeline.
A save that fails (disk full) raises `CheckpointSaveError` with the bytes needed and free, and
leaves the older checkpoints as they were.

One writer per directory (rank 0 in a multi-rank job): a save removes every stale temporary.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import stat
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from watchdog.core.errors import ConfigError, InputError
from watchdog.core.inputs import NotARegularFile, open_regular
from watchdog.fileio import probe_writable, replacing
from watchdog.logs import get_logger

log = get_logger(__name__)

_CHECKPOINT_NAME = re.compile(r"^ckpt-(\d{8,})\.pt$")
_TEMP_PREFIX = ".ckpt-"
_TEMP_SUFFIX = ".tmp"
UNREADABLE_SUFFIX = ".unreadable"


def checkpoint_name(step: int) -> str:
    return f"ckpt-{step:08d}.pt"


def step_of(path: Path) -> int | None:
    """The step a checkpoint file name encodes, or None if the name is not a checkpoint's."""
    match = _CHECKPOINT_NAME.match(path.name)
    return int(match.group(1)) if match else None


def is_regular_file(path: Path) -> bool:
    """A regular file itself (a symbolic link is not, whatever it points at): a checkpoint file in place."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def disagrees_with_name(state: Any, named_step: int | None) -> str | None:
    """Why a checkpoint's contents disagree with its name, or None when they agree (or it holds no step).

    The same rule for single files and sharded steps: the step saved inside must be the step in the
    name, or the file is another checkpoint under a name that is not its own.
    """
    inner = state.get("step") if isinstance(state, dict) else None
    if inner is None or named_step is None:
        return None
    try:
        agrees = int(inner) == named_step
    except (TypeError, ValueError, RuntimeError):  # RuntimeError: a tensor of more than one value
        agrees = False
    return None if agrees else f"holds step {inner!r}, but its name says step {named_step}: not trusted"


class CheckpointSaveError(Exception):
    """A checkpoint could not be written (disk full, quota, I/O error); the older ones are intact."""

    def __init__(self, path: Path, reason: str, bytes_needed: int, bytes_free: int | None):
        free = "unknown" if bytes_free is None else f"{bytes_free:,}"
        super().__init__(f"cannot save {path}: {reason} (needs about {bytes_needed:,} bytes, {free} free)")
        self.path, self.reason, self.bytes_needed, self.bytes_free = path, reason, bytes_needed, bytes_free


@dataclass(frozen=True)
class DiskSpace:
    """Free space where checkpoints go, against the size of the newest one (None: none yet)."""

    free_bytes: int | None
    checkpoint_bytes: int | None

    @property
    def short(self) -> bool:
        """The next checkpoint will probably not fit."""
        return None not in (self.free_bytes, self.checkpoint_bytes) and self.free_bytes < self.checkpoint_bytes

    @classmethod
    def measure(cls, directory: Path, checkpoint_bytes: int | None) -> "DiskSpace":
        """Measured now; logs a warning when the next checkpoint will probably not fit."""
        space = cls(disk_free_bytes(directory), checkpoint_bytes)
        if space.short:
            log.warning("checkpoint_disk_low", directory=str(directory), bytes_free=space.free_bytes,
                        checkpoint_bytes=space.checkpoint_bytes,
                        note="the next checkpoint will probably not fit; free space or move --checkpoint-dir")
        return space


class Timeline:
    """Which checkpoints in a directory are this run's: the "nothing lost" rules, for any layout.

    A run owns what it wrote and what it resumed from (and the older ones of that timeline); it
    prunes only those. Another run's checkpoints are refused at start (`refuse_or_replace`: exit 2
    naming the directory and the ways out), or, when told to replace them, deleted only after this
    run's first save. An unusable checkpoint newer than the resume point, or one in the way of a
    save, is renamed aside (`*.unreadable`), never deleted. Checkpoints are keyed by step; `paths`
    are files (`ckpt-*.pt`) or directories (sharded `step-*/`), `remove` deletes one. `in_place`
    says whether an entry is a checkpoint of that layout itself (not a symbolic link): only those
    can be this run's, so a link or a skipped (untrusted, unusable) entry is never pruned.
    """

    def __init__(self, directory: Path, keep_last: int, step_of: Callable[[Path], int | None],
                 remove: Callable[[Path], None], in_place: Callable[[Path], bool]):
        self.directory, self.keep_last = directory, keep_last
        self._step_of, self._remove, self._in_place = step_of, remove, in_place
        self._own: set[str] = set()  # names on this run's timeline: written by it, or resumed from
        self._to_replace: list[Path] = []  # another run's, deleted after this run's first save

    def resumed(self, existing: list[Path], loaded: Path, skipped: list[Path], writer: bool = True) -> None:
        """This run continues from `loaded`: the timeline up to it is ours; newer unusable ones go aside."""
        step = self._step_of(loaded)
        self._own.update(p.name for p in existing
                         if self._step_of(p) <= step and p not in skipped and self._in_place(p))
        if writer:
            for path in skipped:
                if self._step_of(path) > step:
                    set_aside(path, "not usable, and newer than the checkpoint this run continues from")

    def refuse_or_replace(self, existing: list[Path], *, resumed_none: bool, overwrite: bool) -> None:
        """Nothing of `existing` is being continued: refuse (InputError), or replace them after the first save."""
        if resumed_none:
            problem = (f"none of its {len(existing)} checkpoint(s) loads (newest: {existing[-1].name}); "
                       "refusing to train from step 0 over them")
        else:
            problem = (f"holds {len(existing)} checkpoint(s) of another run (newest: {existing[-1].name}); "
                       "refusing to start over it (--resume auto continues it)")
        if not overwrite:
            raise InputError(f"--checkpoint-dir {self.directory}: {problem}; use a fresh --checkpoint-dir, "
                             "or --overwrite-checkpoints to replace them")
        self._to_replace = existing
        log.warning("checkpoints_to_be_replaced", directory=str(self.directory), count=len(existing),
                    newest=existing[-1].name, note="deleted after this run's first checkpoint (--overwrite-checkpoints)")

    def before_write(self, final: Path) -> None:
        """Never overwrite a checkpoint this run did not write (unless told to replace it)."""
        if final.exists() and final.name not in self._own and final not in self._to_replace:
            set_aside(final, "another run's checkpoint in the way of this run's save")

    def written(self, final: Path, listing: list[Path]) -> None:
        """`final` is committed: it is ours; replaced runs go; this timeline is pruned to `keep_last`."""
        self._own.add(final.name)
        for path in self._to_replace:
            if path.name not in self._own and path.exists():
                self._remove(path)
                log.warning("checkpoint_replaced", path=str(path), note="--overwrite-checkpoints")
        self._to_replace = []
        own = [path for path in listing if path.name in self._own and self._in_place(path)]
        for path in own[:-self.keep_last]:
            self._remove(path)
            self._own.discard(path.name)


def set_aside(path: Path, reason: str) -> None:
    """Rename a checkpoint out of the timeline (never delete it): it stays for a person to look at."""
    target = path.with_name(path.name + UNREADABLE_SUFFIX)
    serial = 1
    while target.exists():
        target = path.with_name(f"{path.name}{UNREADABLE_SUFFIX}-{serial}")
        serial += 1
    try:
        os.replace(path, target)
    except FileNotFoundError:
        return
    log.warning("checkpoint_set_aside", path=str(path), renamed_to=target.name, reason=reason)


class CheckpointManager:
    """Saves `ckpt-{step:08d}.pt` atomically in `directory`, keeps the newest `keep_last` of this run's
    timeline, loads the newest good one.

    `format` and `required_keys` describe a usable checkpoint: a dict that lacks one of the keys or
    carries another `format` is skipped like a torn file (None: no check).
    """

    def __init__(self, directory: str | os.PathLike, keep_last: int = 3, *, format: int | None = None,
                 required_keys: tuple[str, ...] = ()):
        if keep_last < 1:
            raise ConfigError("keep_last", f"must be at least 1, got {keep_last}")
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.format = format
        self.required_keys = required_keys
        self.timeline = Timeline(self.directory, keep_last, step_of, lambda path: path.unlink(missing_ok=True),
                                 is_regular_file)
        self._skipped: list[Path] = []  # files the last load_latest could not use
        self._loaded: Path | None = None  # the file the last load_latest returned
        ensure_writable_directory(self.directory)

    def list(self) -> list[Path]:
        """Checkpoint files, oldest step first. Temporaries and foreign files are not listed."""
        found = [(step, path) for path in self.directory.iterdir() if (step := step_of(path)) is not None]
        return [path for _, path in sorted(found)]

    def latest_step(self) -> int | None:
        """The newest step on disk, from the file names (load_latest is what proves a file readable)."""
        files = self.list()
        return step_of(files[-1]) if files else None

    def open_run(self, *, resume: bool, overwrite: bool = False, writer: bool = True) -> dict | None:
        """Settle what is already in the directory, before the first step; returns the state to resume from.

        - nothing there: None, start fresh;
        - `resume` and one loads: that one (the run continues its timeline; newer unusable files
          are renamed aside when `writer`);
        - otherwise another run's checkpoints are there: InputError (exit 2) naming the directory
          and the ways out, unless `overwrite`, which replaces them once this run has saved its own.
        """
        existing = self.list()
        if not existing:
            return None
        if resume:
            state = self.load_latest()
            if state is not None:
                self.timeline.resumed(existing, self._loaded, self._skipped, writer)
                return state
        self.timeline.refuse_or_replace(existing, resumed_none=resume, overwrite=overwrite)
        return None

    def save(self, state: dict, step: int) -> Path:
        """Write `state` for `step` atomically, then prune this run's timeline to the newest `keep_last`.

        Tensors are moved to CPU first, so a checkpoint taken on XLA or CUDA loads anywhere. A
        failure raises CheckpointSaveError and leaves every older checkpoint as it was.
        """
        import torch

        if step < 0:
            raise InputError(f"checkpoint step must be >= 0, got {step}")
        self._remove_stale_temporaries()
        final = self.directory / checkpoint_name(step)
        self.timeline.before_write(final)
        cpu_state = tensors_to_cpu(state)
        try:
            # a failed or interrupted save leaves no debris (the helper removes its temporary), and
            # the older checkpoints intact
            with replacing(final, prefix=f"{_TEMP_PREFIX}{step:08d}.", suffix=_TEMP_SUFFIX) as handle:
                torch.save(cpu_state, handle)
        except (OSError, RuntimeError) as exc:  # torch turns its writer's ENOSPC into a RuntimeError
            disk_error = _os_error_in(exc)
            if disk_error is None:
                raise  # not the disk: a bug, with its traceback
            raise CheckpointSaveError(final, disk_error.strerror or type(disk_error).__name__,
                                      max(payload_bytes(cpu_state), self._newest_size()),
                                      disk_free_bytes(self.directory)) from exc
        self.timeline.written(final, self.list())
        log.info("checkpoint_saved", path=str(final), step=step, bytes=final.stat().st_size)
        return final

    def load_latest(self, map_location: Any = "cpu") -> dict | None:
        """The newest checkpoint that loads, is usable and is trusted, or None when there is none.

        A torn, corrupt, unsafe (needs arbitrary unpickling), unusable (no model, another format)
        or untrusted (a symbolic link or no regular file; a step inside other than its name's) file
        is skipped with a warning naming the file and the reason, and the one before it is tried.
        """
        import torch

        self._skipped = []
        for path in reversed(self.list()):
            try:
                # never through a link, never an open that waits (a FIFO): see the module's docstring
                with open_regular(path, "rb", follow_symlinks=False) as handle, warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # torch's pickle-protocol advice is noise for a file we refuse
                    state = torch.load(handle, map_location=map_location, weights_only=True)
            except Exception as exc:  # any failure to read means "not usable", never "crash the resume"
                self._skip(path, _load_failure(exc))
                continue
            problem = self._unusable(state) or disagrees_with_name(state, step_of(path))
            if problem is not None:
                self._skip(path, problem)
                continue
            log.info("checkpoint_loaded", path=str(path), step=step_of(path))
            self._loaded = path
            return state
        return None

    def disk_space(self) -> DiskSpace:
        """Free bytes under the directory and the newest checkpoint's size; logs a warning when short."""
        return DiskSpace.measure(self.directory, self._newest_size() or None)

    def _unusable(self, state: Any) -> str | None:
        if not isinstance(state, dict):
            return f"holds a {type(state).__name__}, not a dict"
        if self.format is not None and state.get("format") != self.format:
            found = "no format field" if "format" not in state else f"format {state['format']!r}"
            return f"{found}, expected format {self.format}"
        missing = [key for key in self.required_keys if key not in state]
        return f"no {', '.join(repr(k) for k in missing)} in it" if missing else None

    def _skip(self, path: Path, reason: str) -> None:
        log.warning("checkpoint_skipped", path=str(path), reason=reason)
        self._skipped.append(path)

    def _newest_size(self) -> int:
        for path in reversed(self.list()):
            try:
                return path.stat().st_size
            except OSError:
                continue
        return 0

    def _remove_stale_temporaries(self) -> None:
        """Temporaries left by a writer that died mid-save (SIGKILL, OOM killer, power loss)."""
        for path in self.directory.glob(f"{_TEMP_PREFIX}*{_TEMP_SUFFIX}"):
            log.info("checkpoint_stale_temporary_removed", path=str(path))
            path.unlink(missing_ok=True)



def ensure_writable_directory(directory: Path) -> None:
    """Create the directory and prove it writable now, not at the first save an hour into training."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe_writable(directory, prefix=f"{_TEMP_PREFIX}probe.", suffix=_TEMP_SUFFIX)
    except OSError as exc:
        raise InputError(f"checkpoint directory {directory} is not writable: "
                         f"{exc.strerror or type(exc).__name__}") from None


def disk_free_bytes(directory: Path) -> int | None:
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return None


def _os_error_in(exc: BaseException) -> OSError | None:
    """The OS's error behind a failed save. torch reports its writer's ENOSPC as an opaque
    `[enforce fail at inline_container.cc] unexpected pos`; the OSError is in the chain."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _load_failure(exc: BaseException) -> str:
    """Why a file did not load, in one line. torch's advice to retry with weights_only=False is
    left out: it is wrong for a torn or garbage file and unsafe for a malicious one."""
    if isinstance(exc, NotARegularFile):
        return f"{exc.kind}, not a regular file in the directory: not trusted"
    text = str(exc)
    if "Weights only load failed" in text:
        detail = text.partition("WeightsUnpickler error:")[2].strip().splitlines()
        first = detail[0].split(" Please use")[0].strip() if detail else ""
        return "refused by the safe loader (weights_only=True)" + (f": {first}" if first else "")
    if isinstance(exc, EOFError):
        return "empty or cut short (EOFError)"
    return one_line(exc)


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def payload_bytes(value: Any) -> int:
    """Bytes of tensor data in a nested state: what a checkpoint of it needs, give or take its pickle."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(payload_bytes(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return sum(payload_bytes(item) for item in value)
    return 0


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
