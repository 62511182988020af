"""The README's quick start is the contract with new users: CI must run its test command verbatim."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command_verbatim():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    command = ci[ci.index("# README test command:") + 1]
    readme = (ROOT / "README.md").read_text()
    assert f"\n{command}\n" in readme


def test_quick_start_is_exactly_two_commands():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(?:bash|sh)\n(.*?)```", section, flags=re.S)
    commands = [line for block in blocks for line in block.splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    assert len(commands) == 2, commands
    assert "hbm-watchdog train" in commands[0] and "--inject-leak" in commands[0]
    assert "pytest" in commands[1]


def test_ci_lists_the_twenty_slowest_tests():
    assert "--durations=20" in (ROOT / ".ci" / "run").read_text()


def _all_python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


# What a user's own code supplies to the README's snippets: their step, checkpoint, model and data.
USERS_OWN = {"train_step", "save", "rebuild", "start", "steps", "model", "val_loader", "data"}


def _free_names(snippet: str) -> set[str]:
    """Names a snippet reads that it neither imports nor assigns, and Python does not provide."""
    import builtins

    tree = ast.parse(snippet)
    bound = {alias.asname or alias.name.split(".")[0]
             for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names}
    bound |= {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load)}
    read = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}
    return read - bound - set(dir(builtins))


def test_every_python_snippet_in_the_readme_imports_what_it_uses():
    """Each snippet is whole Python, and every name it reads is imported or assigned in it, or is
    one of the user's own (their step, save, rebuild, model, data): copied alone, it runs."""
    snippets = _all_python_blocks()
    assert len(snippets) >= 5, "the snippets are where the test looks"
    leftovers = {i: sorted(_free_names(snippet) - USERS_OWN) for i, snippet in enumerate(snippets)}
    assert {i: names for i, names in leftovers.items() if names} == {}


def test_the_check_finds_a_name_a_snippet_forgot_to_import():
    assert _free_names("from watchdog import Watchdog\nif Watchdog() is Action.NONE: pass\n") == {"Action"}


def _python_blocks(heading: str) -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split(f"\n{heading}\n", 1)[1].split("\n#", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


@pytest.mark.slow  # the snippet's device is the default one: torch_xla's, wherever it is imported
def test_the_own_loop_snippet_runs_as_written_and_carries_out_an_action(tmp_path, monkeypatch):
    """The first snippet of "A loop of your own", run on the CPU with a real model, a save and a
    rebuild of its own; the budget is made small enough that the watchdog acts."""
    import torch

    from conftest import settled_job_memory

    monkeypatch.chdir(tmp_path)
    snippet = _python_blocks("### A loop of your own")[0]
    budget = settled_job_memory() + (400 << 20)
    snippet = snippet.replace("memory_limit_bytes=15 << 30", f"memory_limit_bytes={budget}")
    assert f"memory_limit_bytes={budget}" in snippet, "the snippet's budget is where the test expects it"
    kept, saved, rebuilt = [], [], []

    def train_step():
        kept.append(torch.ones(1 << 18))  # 1 MiB a step that nobody frees: the leak

    def save():
        saved.append(len(kept))
        return tmp_path / f"ckpt-{len(saved)}.pt"

    def rebuild():
        kept.clear()
        rebuilt.append(True)

    namespace = {"train_step": train_step, "save": save, "rebuild": rebuild, "start": 0, "steps": 600}
    exec(compile(snippet, "README.md", "exec"), namespace)
    assert saved and rebuilt, "the watchdog acted and carry_out saved and rebuilt"
    assert max(saved) * (1 << 20) < 400 << 20, "before the budget"
    assert (tmp_path / "trace.csv").exists()


@pytest.mark.slow  # the snippets' device is the default one: torch_xla's, wherever it is imported
def test_the_plain_loop_and_the_phase_snippets_run_as_written(tmp_path, monkeypatch):
    """The other snippets of "A loop of your own" and "Phases", each alone, with the user's own
    step, save, rebuild, model and data (the first snippet, Lightning's and Hugging Face's run in
    their own tests)."""
    monkeypatch.chdir(tmp_path)
    plain = _python_blocks("### A loop of your own")[1]
    steps_taken: list[int] = []
    names = {"train_step": lambda: steps_taken.append(1), "save": lambda: None, "rebuild": lambda: None,
             "start": 0, "steps": 25}
    exec(compile(plain, "README.md", "exec"), names)
    assert len(steps_taken) == 25 and names["wd"].telemetry.samples_total >= 1, "the watchdog sampled the loop"

    phase = _python_blocks("### Phases: evaluations that keep their outputs")[0]
    names = {"model": lambda batch: batch * 2, "val_loader": list(range(20))}
    exec(compile(phase, "README.md", "exec"), names)
    assert names["predictions"] == [2 * b for b in range(20)] and names["counter"] == 20
    assert names["wd"].telemetry.samples_total >= 1  # a sample posted while one is read is skipped: best effort


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {_slug(m) for m in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


def test_every_relative_link_in_the_readme_and_docs_resolves():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    assert len(pages) > 5, "the docs pages exist"
    broken, checked = [], 0
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target) or target.startswith("mailto:"):
                continue
            path_part, _, anchor = target.partition("#")
            resolved = (page.parent / path_part).resolve() if path_part else page
            checked += 1
            if not resolved.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert checked > 10 and not broken, broken


def test_the_front_page_stays_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300
