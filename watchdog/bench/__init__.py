"""Labelled trace corpora, baseline detectors, scoring, and the long measurements (`hbm-watchdog
bench`).

Its modules, one job each, are mapped in watchdog/ARCHITECTURE.md (Layers).
"""
