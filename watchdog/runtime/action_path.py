"""`watchdog.actions.action_path` under its old name, with a deprecation line, for one release
(moved for issue 59: an action's life in one room, watchdog/ARCHITECTURE.md's map)."""

from watchdog.moved import moved

moved(__name__, "watchdog.actions.action_path")
