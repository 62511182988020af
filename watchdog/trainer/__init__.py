"""The instrumented trainer: a small transformer LM with activation checkpointing, deliberate
leaks, and the watchdog attached, to show the whole loop end to end on any machine. Nothing here
imports torch at package import: the CLI stays fast to start.

Its modules, one job each, are mapped in watchdog/ARCHITECTURE.md (Layers).
"""
