"""Callbacks that make a framework's trainer drive the `Watchdog` (Lightning, Hugging Face).

Its modules, one job each, are mapped in watchdog/ARCHITECTURE.md (Layers).
"""
