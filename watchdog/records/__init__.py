"""The files a watched process leaves for readers outside it: the flight record (what the watchdog
knew, for `postmortem`) and the job file (every process's steps and spans, for `goodput`). Each
file's fields are listed once, in the core, for its writer here and its readers alike
(`core/postmortem.RECORD_FIELDS`, `core/goodput.FIELDS`).

Its modules are mapped in watchdog/ARCHITECTURE.md (Layers).
"""
