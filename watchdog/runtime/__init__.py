"""Inside a training process: memory sources, the sidecar thread (`Watchdog`), XLA's counters, the
flight record and the job file. Feeds the station, never decides.

Its modules, one job each, are mapped in watchdog/ARCHITECTURE.md (Layers).
"""
