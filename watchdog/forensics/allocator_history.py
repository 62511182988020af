"""Where CUDA memory was allocated, from the caching allocator's own record, while a capture runs.

The creation-site capture (`CreationSites`) sees the tensors Python code makes through torch
functions. The allocator sees every block, including those made where no torch function is
called from Python: the gradients and saved tensors of a backward, a library's workspaces. On a
CUDA process the capture also asks the allocator to keep the Python stack of each block it hands
out (`torch.cuda.memory._record_memory_history(enabled="state", stacks="python")`): a stack per
live block, dropped with the block, and no ring of past events, so what it keeps is bounded by
what is alive (`max_entries` bounds the ring should a torch keep one anyway). At the capture's
end one snapshot is read and recording is turned off again, so it costs nothing outside the
window. A program that records its own history keeps it: it is read, never turned off.

    history = AllocatorHistory.of_this_process()   # None without CUDA in use
    history.start()
    ...                                            # the captured steps
    blocks = history.stop()                        # the live blocks with their stacks
"""

from __future__ import annotations

import sys
from typing import Callable, NamedTuple

from watchdog.logs import get_logger

log = get_logger(__name__)

RawFrame = tuple[str, int, str]  # filename, line, function: innermost first


class Block(NamedTuple):
    """A live allocation and the stack that made it (empty where it was made before recording)."""

    address: int
    size: int
    frames: tuple[RawFrame, ...]


class AllocatorHistory:
    """Turns the allocator's stack recording on for a capture, and reads it at its end."""

    def __init__(self, memory: object, recording: Callable[[], bool], max_entries: int = 100_000):
        self._memory = memory  # torch.cuda.memory, or a stand-in with its two functions
        self._recording = recording  # whether the allocator records stacks now
        self.max_entries = max_entries
        self._ours = False  # whether we turned recording on (and so turn it off)

    @classmethod
    def of_this_process(cls, max_entries: int = 100_000) -> AllocatorHistory | None:
        """The history of this process's CUDA allocator, or None where CUDA is not in use: asking
        an uninitialised CUDA would create a context (hundreds of MB of the device)."""
        torch = sys.modules.get("torch")
        if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return None
        recording = getattr(torch._C, "_cuda_isHistoryEnabled", None) or (lambda: False)
        return cls(torch.cuda.memory, recording, max_entries)

    def start(self) -> None:
        if self._recording():
            self._ours = False
            return
        self._memory._record_memory_history(enabled="state", context="state", stacks="python",
                                                 max_entries=self.max_entries)
        self._ours = True

    def stop(self) -> list[Block]:
        """The live blocks now, with their stacks; recording off again if we turned it on. Never raises."""
        try:
            return live_blocks(self._memory._snapshot())
        except Exception as exc:  # noqa: BLE001 - the census goes on without these sites
            log.warning("allocator_snapshot_failed", error=f"{type(exc).__name__}: {exc}")
            return []
        finally:
            if self._ours:
                self._ours = False
                try:
                    self._memory._record_memory_history(enabled=None)
                except Exception as exc:  # noqa: BLE001
                    log.warning("allocator_history_stop_failed", error=f"{type(exc).__name__}: {exc}")


def live_blocks(snapshot: dict) -> list[Block]:
    """The blocks in use by tensors in a `torch.cuda.memory._snapshot()`, with their frames.

    Snapshots from torch 2.1 on give each block its `frames`; 2.0's gave a `history` whose first
    entry has them. A block waiting for another stream (`active_awaiting_free`) is on its way out."""
    blocks = []
    for segment in snapshot.get("segments", ()):
        for block in segment.get("blocks", ()):
            if block.get("state") != "active_allocated":
                continue
            frames = block.get("frames")
            if frames is None:
                history = block.get("history") or [{}]
                frames = history[0].get("frames", ())
            blocks.append(Block(int(block["address"]), int(block["size"]),
                                tuple((str(f.get("filename", "?")), int(f.get("line", 0)), str(f.get("name", "?")))
                                      for f in frames)))
    return blocks
