"""An action's life once decided: its path to the training loop and through it (`action_path`),
its record (`record`), the ranks' agreement on it (`agreement`), the checkpoints it saves (plain
and sharded) and the supervisor that restarts a job which exited 42.

Its modules, one job each, are mapped in watchdog/ARCHITECTURE.md (Layers).
"""
