"""hbm-watchdog: predict device-memory exhaustion in long training jobs and act before it.

The public surface is small on purpose::

    from watchdog import Watchdog, WatchdogConfig

    with Watchdog(WatchdogConfig(sample_every=10, memory_limit_bytes=16 << 30)) as wd:
        for step in range(steps):
            train_step()
            action = wd.step(step)
            if action is not None:
                ...  # checkpoint and reinit, or checkpoint and exit 42

Heavy modules (torch, torch_xla) are imported lazily so that `hbm-watchdog analyze` starts fast.
"""

from __future__ import annotations

__version__ = "0.1.0"
__hbm_watchdog__ = True  # tells this package apart from the file-events `watchdog` (commands/clash.py)

__all__ = ["Watchdog", "WatchdogConfig", "PolicyConfig", "DetectorConfig", "Action", "Verdict", "Status", "Sample",
           "__version__"]


def __getattr__(name: str):
    # Lazy re-exports keep `import watchdog` cheap and free of threads and torch.
    if name == "Watchdog":
        from watchdog.runtime.sidecar import Watchdog

        return Watchdog
    if name == "WatchdogConfig":
        from watchdog.core.config import WatchdogConfig

        return WatchdogConfig
    if name == "PolicyConfig":  # WatchdogConfig(policy=PolicyConfig(...)): when to act, and how
        from watchdog.core.policy import PolicyConfig

        return PolicyConfig
    if name == "DetectorConfig":  # WatchdogConfig(detector=DetectorConfig(...)): what counts as growth
        from watchdog.core.detector import DetectorConfig

        return DetectorConfig
    if name in ("Action", "Verdict", "Status"):
        from watchdog.core import verdict

        return getattr(verdict, name)
    if name == "Sample":
        from watchdog.core.sample import Sample

        return Sample
    raise AttributeError(f"module 'watchdog' has no attribute {name!r}")
