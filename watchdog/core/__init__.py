"""The pure core: sample -> detector -> verdict -> policy -> action, and the judge that wires them.

Nothing here starts a thread, touches a file other than a trace CSV, or imports torch, so every
decision the watchdog takes can be replayed and tested sample by sample.

Its modules, one job each, are mapped in watchdog/ARCHITECTURE.md (Layers).
"""
