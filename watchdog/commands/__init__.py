"""The `hbm-watchdog` command line: routing (`cli`) and the subcommands that are not a part of
their own (`analyze`, `report`, `supervise`); `train` and `bench` live with their packages."""
