"""Sharded checkpoints for SPMD: torch.distributed.checkpoint (DCP) through torch_xla's SPMD planners.

Under SPMD no device holds a whole parameter, and on a multi-host slice no host does either, so
a checkpoint is written shard by shard: every process writes the shards its devices hold
(`SPMDSavePlanner`), and a load reads each shard straight into the matching shard of a freshly
built, already sharded state (`SPMDLoadPlanner`). DCP reshards on load, so a checkpoint taken on
4 devices loads on 2.

On disk, one directory per step:

    step-00000300/
        .metadata       DCP's index of every tensor and its chunks
        __0_0.distcp    the shards this process wrote (one file per process)
        host.pt         what is not a device tensor: step, data position, RNG, LR schedule,
                        optimizer hyper-parameters, restart count (rank 0 writes it)

Why not torch_xla's own `CheckpointManager`: it writes straight into the step directory and
tells a complete step from a torn one by a pickled marker file, which it then unpickles; here a
step is written under a temporary name and renamed into place only once complete (the
rename is the commit, as for the single-file checkpoints), and nothing on disk is unpickled
without an allow-list. The temporary name is random (`.tmp-step-00000300.<random>`, made by rank
0 through watchdog/fileio.py and passed to the other processes), so nobody can plant a link or
a directory of links under it beforehand.

`weights_only` safety, as for the single-file checkpoints: DCP itself loads tensor data with
`torch.load(weights_only=True)`; `host.pt` is loaded the same way; DCP's `.metadata` is a plain
pickle, so it is read through an unpickler that admits only DCP's own metadata records; and
nothing is ever stored as a pickled DCP "bytes" item (only tensors go to DCP).

Trust, as for the single-file checkpoints: a step is read only when it is a directory in the
checkpoint directory (not a symbolic link), every file in it is a regular file (DCP opens its
shards itself, and a FIFO there would hang it), `.metadata` names no file outside the step, and
the step in `host.pt` is the step in the directory's name; any other is skipped like a torn one.

Every process calls `save` and `load_latest` at the same step: both are collective when
torch.distributed is initialised (a multi-host slice). In one process they need no process group.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pickle
import re
import shutil
import stat
import warnings
from pathlib import Path
from typing import Any, Callable

from watchdog.actions.checkpoint import (
    DiskSpace,
    Timeline,
    disagrees_with_name,
    ensure_writable_directory,
    one_line,
)
from watchdog.core.errors import ConfigError, InputError
from watchdog.core.inputs import NotARegularFile, kind_of, open_regular
from watchdog.fileio import fsync_directory, replacing, temporary_directory
from watchdog.logs import get_logger

log = get_logger(__name__)

_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_TEMP_PREFIX = ".tmp-step-"
HOST_FILE = "host.pt"
METADATA_FILE = ".metadata"  # DCP's name, written last by DCP itself


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def step_of(path: Path) -> int | None:
    match = _STEP_DIR.match(path.name)
    return int(match.group(1)) if match else None


def is_real_directory(path: Path) -> bool:
    """A directory itself (a symbolic link to one is not): a step in place."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


class UntrustedStep(Exception):
    """A step directory that is not what its place and name say; the message is the reason."""


def check_step_files(directory: str | os.PathLike) -> None:
    """NotARegularFile unless every entry of a step directory is a regular file (DCP opens them blindly)."""
    with os.scandir(directory) as entries:
        for entry in entries:
            kind = kind_of(entry.stat(follow_symlinks=False).st_mode)
            if kind is not None:
                raise NotARegularFile(entry.path, kind)


class ShardedCheckpointManager:
    """`step-{step:08d}/` DCP checkpoints in `directory`: atomic commit, keep-last-k, newest good one."""

    def __init__(self, directory: str | os.PathLike, keep_last: int = 3):
        if keep_last < 1:
            raise ConfigError("keep_last", f"must be at least 1, got {keep_last}")
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.timeline = Timeline(self.directory, keep_last, step_of,
                                 lambda path: shutil.rmtree(path, ignore_errors=True), is_real_directory)
        self._skipped: list[Path] = []  # steps the last load_latest could not use
        self._loaded: Path | None = None
        if _rank() == 0:
            ensure_writable_directory(self.directory)
        _barrier()

    # -- listing ------------------------------------------------------------------------------

    def list(self) -> list[Path]:
        """Committed step directories, oldest first. Temporaries and foreign entries are not listed."""
        found = [(step, path) for path in self.directory.iterdir()
                 if path.is_dir() and (step := step_of(path)) is not None]
        return [path for _, path in sorted(found)]

    def latest_step(self) -> int | None:
        steps = self.list()
        return step_of(steps[-1]) if steps else None

    # -- save ---------------------------------------------------------------------------------

    def save(self, payload: dict, step: int) -> Path:
        """Write `payload` for `step`: its device tensors through DCP, the rest to host.pt; then commit.

        Collective: every process calls it with its own view of the same (sharded) state.
        """
        import torch
        import torch.distributed.checkpoint as dcp
        import torch_xla.core.xla_model as xm
        from torch_xla.experimental.distributed_checkpoint import SPMDSavePlanner

        if step < 0:
            raise InputError(f"checkpoint step must be >= 0, got {step}")
        xm.wait_device_ops()  # the step's sync runs asynchronously; the planner reads the shards' data
        device_tree, host_tree = split_device_tensors(payload)
        final = self.directory / step_dir_name(step)
        rank = _rank()
        temp = _from_rank_0(self._fresh_temporary(step) if rank == 0 else None)  # one directory for every host
        try:
            with _quiet_dcp():
                dcp.save(device_tree, storage_writer=dcp.FileSystemWriter(temp, sync_files=True),
                         planner=SPMDSavePlanner())
            if rank == 0:
                with replacing(temp / HOST_FILE) as handle:
                    torch.save(host_tree, handle)
        except BaseException:
            if rank == 0:
                shutil.rmtree(temp, ignore_errors=True)  # a failed save leaves no debris
            raise
        _barrier()  # every shard is on disk before the step is committed
        if rank == 0:
            self._commit(temp, final)
        _barrier()  # nobody reads the directory while rank 0 is renaming and pruning
        log.info("checkpoint_saved", path=str(final), step=step, format="dcp", bytes=_size(final))
        return final

    def _commit(self, temp: Path, final: Path) -> None:
        """The rename is the commit: before it the step does not exist, after it the step is whole."""
        self.timeline.before_write(final)  # another run's step of the same number goes aside, never deleted
        if final.exists():  # this run's own step again (a reinit at the same step): replace it
            stale = temporary_directory(self.directory, f"{_TEMP_PREFIX}{final.name}.replaced.")
            os.replace(final, stale)  # onto the empty directory just made: a name nobody could plant
            shutil.rmtree(stale, ignore_errors=True)
        os.replace(temp, final)
        fsync_directory(self.directory)
        self.timeline.written(final, self.list())

    def _fresh_temporary(self, step: int) -> Path:
        """Where rank 0 has every process write `step`: a new directory under a random name (a
        predictable one could be planted beforehand, as a link or a directory of links), named so
        that `_remove_stale_temporaries` recognises it."""
        self._remove_stale_temporaries()
        return temporary_directory(self.directory, f"{_TEMP_PREFIX}{step:08d}.")

    def _remove_stale_temporaries(self) -> None:
        """What a writer killed mid-save left behind (SIGKILL, the OOM killer, preemption)."""
        for path in self.directory.glob(f"{_TEMP_PREFIX}*"):
            log.info("checkpoint_stale_temporary_removed", path=str(path))
            shutil.rmtree(path, ignore_errors=True)

    def disk_space(self) -> DiskSpace:
        """Free bytes under the directory against the newest step's size (see CheckpointManager)."""
        steps = self.list()
        return DiskSpace.measure(self.directory, _size(steps[-1]) if steps else None)

    # -- load ---------------------------------------------------------------------------------

    def open_run(self, into: dict, *, resume: bool, overwrite: bool = False,
                 check: Callable[[dict], None] | None = None) -> dict | None:
        """Settle what is already in the directory, as `CheckpointManager.open_run` does, with the
        same `Timeline` rules; returns the payload to resume from (read into `into`), or None."""
        existing = self.list()
        if not existing:
            return None
        if resume:
            payload = self.load_latest(into, check)
            if payload is not None:
                self.timeline.resumed(existing, self._loaded, self._skipped, writer=_rank() == 0)
                _barrier()
                return payload
        self.timeline.refuse_or_replace(existing, resumed_none=resume, overwrite=overwrite)
        return None

    def load_latest(self, into: dict, check: Callable[[dict], None] | None = None) -> dict | None:
        """The newest checkpoint that loads, read into `into`'s device tensors in place; None if none.

        `into` is a payload of the same shape as the saved ones, built from a fresh state that is
        already sharded (and whose optimizer state exists): its device tensors receive the shards.
        The result is the saved host values with those tensors in their places. `check(host)` may
        refuse a checkpoint with an InputError (a different model), which is raised, not skipped.
        A torn, corrupt, unsafe or untrusted (see the module's docstring) step is skipped with a
        warning naming it, for the one before.
        """
        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException
        from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner

        device_tree, _ = split_device_tensors(into)
        self._skipped = []
        for path in reversed(self.list()):
            try:
                host = trusted_host_values(path)
                if check is not None:
                    check(host)
                load_metadata(path)  # read it first: DCP turns a refused or missing one into a bare assert
                with _quiet_dcp():
                    dcp.load(device_tree, storage_reader=allow_list_reader(path), planner=SPMDLoadPlanner())
            except NotARegularFile as exc:  # an InputError, but a step's content: skipped, never fatal
                log.warning("checkpoint_skipped", path=str(path), reason=f"{exc}: not trusted")
                self._skipped.append(path)
                continue
            except InputError:
                raise
            # Any failure to read means "not usable", never "crash the resume". DCP reports its
            # failures as CheckpointException, which derives from BaseException, not Exception.
            except (Exception, CheckpointException) as exc:
                log.warning("checkpoint_skipped", path=str(path), reason=one_line(_first_cause(exc)))
                self._skipped.append(path)
                continue
            log.info("checkpoint_loaded", path=str(path), step=step_of(path), format="dcp")
            self._loaded = path
            return merge_trees(host, device_tree)
        return None


def trusted_host_values(path: Path) -> dict:
    """A step's host values, read only once the step is trusted as far as can be told before DCP reads it."""
    import torch

    if not is_real_directory(path):
        raise UntrustedStep(f"not a directory in {path.parent} (a symbolic link?): not trusted")
    check_step_files(path)
    with open_regular(path / HOST_FILE, "rb", follow_symlinks=False) as handle:
        host = torch.load(handle, map_location="cpu", weights_only=True)
    if not isinstance(host, dict):
        raise TypeError(f"{HOST_FILE} holds a {type(host).__name__}, not a dict")
    problem = disagrees_with_name(host, step_of(path))
    if problem is not None:
        raise UntrustedStep(f"{HOST_FILE} {problem}")
    return host


def _first_cause(exc: BaseException) -> BaseException:
    """DCP wraps each rank's failure in a CheckpointException: the reason is the first rank's."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        return next(iter(failures.values()))[0]
    return exc


# ---- the payload: device tensors to DCP, everything else to host.pt ---------------------------------

def split_device_tensors(tree: dict) -> tuple[dict, dict]:
    """(device tensors, the rest) of a nested dict; both keep the nesting (dict keys only).

    A device tensor is any tensor not on the CPU: under SPMD, the model's parameters and the
    optimizer's state. CPU tensors (the RNG states) stay with the host values.
    """
    import torch

    device, host = {}, {}
    for key, value in tree.items():
        if isinstance(value, dict):
            device_part, host_part = split_device_tensors(value)
            if device_part:
                device[key] = device_part
            host[key] = host_part
        elif isinstance(value, torch.Tensor) and value.device.type != "cpu":
            device[key] = value
        elif isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) and v.device.type != "cpu"
                                                      for v in value):
            raise TypeError(f"device tensors inside a {type(value).__name__} at {key!r}: put them in a dict")
        else:
            host[key] = value
    return device, host


def merge_trees(host: dict, device: dict) -> dict:
    """The inverse of `split_device_tensors`."""
    merged = dict(host)
    for key, value in device.items():
        merged[key] = merge_trees(merged.get(key, {}), value) if isinstance(value, dict) else value
    return merged


# ---- DCP's .metadata, read without arbitrary unpickling -------------------------------------------

@functools.cache
def _allowed_globals() -> dict[tuple[str, str], Any]:
    """What DCP's `.metadata` is made of (torch 2.9): its records, torch sizes, dtypes and layouts, a path."""
    import pathlib

    import torch
    import torch.distributed.checkpoint.filesystem as dcp_filesystem
    import torch.distributed.checkpoint.metadata as dcp_metadata

    allowed: dict[tuple[str, str], Any] = {
        ("torch", "Size"): torch.Size,
        ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
        ("pathlib", "PosixPath"): pathlib.PosixPath,
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): dcp_filesystem._StorageInfo,
    }
    for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                 "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"):
        allowed[("torch.distributed.checkpoint.metadata", name)] = getattr(dcp_metadata, name)
    for name in dir(torch):
        if isinstance(getattr(torch, name, None), torch.dtype):
            allowed[("torch", name)] = getattr(torch, name)
    return allowed


class _AllowListUnpickler(pickle.Unpickler):
    """Python's "restricting globals" recipe: only DCP's metadata records may be rebuilt."""

    def find_class(self, module: str, name: str) -> Any:
        found = _allowed_globals().get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")
        return found


def load_metadata(directory: str | os.PathLike) -> Any:
    """DCP's `.metadata` of a checkpoint directory, through the allow-list; it may name only files
    of that directory (DCP opens the shards it names, joined to the directory: an absolute or `..`
    name would read anything)."""
    with open_regular(Path(directory) / METADATA_FILE, "rb", follow_symlinks=False) as handle:
        metadata = _AllowListUnpickler(handle).load()
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        name = str(getattr(info, "relative_path", ""))
        if not name or os.path.basename(name) != name or name in (".", ".."):
            raise pickle.UnpicklingError(f"checkpoint metadata names {name!r}, not a file of its directory")
    return metadata


@functools.cache
def _reader_class() -> type:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import StorageMeta

    class AllowListReader(dcp.FileSystemReader):
        """DCP's file reader, with the metadata read through the allow-list instead of pickle.load."""

        def read_metadata(self, *args: Any, **kwargs: Any):
            if kwargs.get("rank") is not None:
                raise ValueError("per-rank metadata files are not used by these checkpoints")
            metadata = load_metadata(self.path)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return AllowListReader


def allow_list_reader(directory: str | os.PathLike):
    """A DCP storage reader for `directory` that never unpickles anything but DCP's metadata records."""
    return _reader_class()(directory)


@contextlib.contextmanager
def _quiet_dcp():
    """Silence what DCP and torch_xla's planners warn on every save and load in torch 2.9 (one process
    on purpose, an older planner signature, their own use of deprecated storage and indexing):
    nothing a user of this tool can act on, and a checkpoint every few minutes would repeat it."""
    with warnings.catch_warnings():
        for message in ("torch.distributed is disabled", "The function definition for SavePlanner",
                        "TypedStorage is deprecated", "Using a non-tuple sequence for multidimensional indexing"):
            warnings.filterwarnings("ignore", message=message, category=UserWarning)
        yield


# ---- processes and files ---------------------------------------------------------------------------

def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _from_rank_0(value: Any) -> Any:
    """Rank 0's `value` on every process (collective; a barrier as well). The peer is this job's own
    rank 0, over the process group the job already trusts with its gradients."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return value


def _size(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.iterdir() if path.is_file())


def read_tensors(directory: str | os.PathLike) -> dict[str, Any]:
    """Every tensor of one checkpoint step, whole and on the CPU, by flattened name (`model.head.weight`).

    For inspection, comparison and conversion off the training job: no device, no process group,
    and the same allow-listed metadata read as a resume.
    """
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    check_step_files(directory)
    metadata = load_metadata(directory)
    tensors = {name: torch.empty(entry.size, dtype=entry.properties.dtype)
               for name, entry in metadata.state_dict_metadata.items() if isinstance(entry, TensorStorageMetadata)}
    with _quiet_dcp():
        dcp.load(tensors, storage_reader=allow_list_reader(directory), no_dist=True)
    return tensors
