"""Inside a training process: memory sources, the sidecar thread (`Watchdog`), XLA's counters. Feeds
the station and the records (`watchdog/records/`: the flight record, the job file), never decides.

Its modules, one job each, are mapped in watchdog/ARCHITECTURE.md (Layers).
"""
