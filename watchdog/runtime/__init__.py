"""Inside a training process: the sidecar thread (`Watchdog`), the action's path, XLA's counters. It
reads memory through `watchdog/readers/` and feeds the station and the records (`watchdog/records/`:
the flight record, the job file); it never decides.

Its modules, one job each, are mapped in watchdog/ARCHITECTURE.md (Layers).
"""
