"""What is leaking, inside a training process: what keeps memory alive, who holds it, where it was
made. Reads metadata only: no device sync, no transfer, no compilation.

Its modules, one job each, are mapped in watchdog/ARCHITECTURE.md (Layers).
"""
