"""The repository stands alone, and its maps (README, ARCHITECTURE.md) match its folders."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "watchdog"


SKIPPED_FOLDERS = {".git", ".venv", "__pycache__", ".pytest_cache", ".hypothesis", "runs", "build"}


def repository_text_files() -> list[Path]:
    return [p for p in ROOT.rglob("*") if p.is_file() and not p.name.endswith((".png", ".gz", ".pyc"))
            and not SKIPPED_FOLDERS.intersection(p.relative_to(ROOT).parts)
            and not any(part.endswith(".egg-info") for part in p.parts)]


def test_nothing_points_outside_the_repository():
    outside = re.compile(r"\.\./shared|design\.md")
    offenders = [str(p.relative_to(ROOT)) for p in repository_text_files()
                 if p.name != Path(__file__).name and outside.search(p.read_text(errors="replace"))]
    assert offenders == []


def test_the_real_traces_ship_with_their_attribution():
    data = PACKAGE / "bench" / "data"
    assert (data / "alibaba_mem_util.csv.gz").stat().st_size > 10_000_000
    notice = (data / "README.md").read_text()
    assert "Apache License" in notice and "ansjin/memory_leak_detection" in notice


def _modules() -> set[str]:
    return {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
            if p.name not in ("__init__.py", "__main__.py") and "data" not in p.parts}


def test_architecture_names_every_layer_folder_and_core_module():
    text = (PACKAGE / "ARCHITECTURE.md").read_text()
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert {f for f in folders if f"{f}/" not in text} == set()
    for layer in ("core", "runtime", "actions"):
        missing = {m for m in _modules() if m.startswith(layer + "/") and Path(m).name not in text}
        assert missing == set(), f"ARCHITECTURE.md does not name {sorted(missing)}"


def test_architecture_is_the_one_map_and_the_readme_links_to_it():
    """One layout map: ARCHITECTURE.md names every module of every layer and every top-level folder;
    the README points to it and copies none of it (a copy drifts)."""
    text = (PACKAGE / "ARCHITECTURE.md").read_text()
    missing = {m for m in _modules() if Path(m).name not in text}
    assert missing == set(), f"ARCHITECTURE.md does not name {sorted(missing)}"
    top = {p.name for p in ROOT.iterdir() if p.name not in SKIPPED_FOLDERS and not p.name.startswith(".git")
           and not p.name.endswith(".egg-info") and p.name != "README.md"}
    assert {f for f in top if f"\n{f}" not in text} == set(), "a top-level entry missing from the map"
    readme = (ROOT / "README.md").read_text()
    assert "(watchdog/ARCHITECTURE.md#layers)" in readme
    assert not re.search(r"^  core/", readme, flags=re.M), "the README copies the layout instead of linking it"
