"""The `hbm-watchdog` command line: `cli` routes each subcommand to its module (`train` and `bench`
live with their packages).

Its modules, one job each, are mapped in watchdog/ARCHITECTURE.md (Layers).
"""
