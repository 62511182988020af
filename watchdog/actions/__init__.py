"""What is done about a verdict: atomic checkpoints (plain and sharded), and the supervisor that
restarts a job which exited 42.

Its modules, one job each, are mapped in watchdog/ARCHITECTURE.md (Layers).
"""
