"""`watchdog.records.job_ledger` under its old name, with a deprecation line, for one release
(moved for issue 59: watchdog/ARCHITECTURE.md's map)."""

from watchdog.moved import moved

moved(__name__, "watchdog.records.job_ledger")
