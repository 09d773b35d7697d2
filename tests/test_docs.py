"""README.md and docs/ as a user meets them: every command block marked runnable on CPU runs as written, the
output a page shows for it is the output it prints, every relative link points at a file and heading that
exist, and docs/config.md is what loom/config_reference.py writes from the config dataclasses.

The marker is the fence's info string: a block opened with ```` ```bash cpu ```` runs (in bash, `set -euo
pipefail`) from a fresh folder that holds copies of the repository's configs/ and examples/ and a link to loom/,
with `loom` on PATH running this tree; ```` ```bash cpu exit=2 ```` expects that exit code instead of 0. A block
opened with ```` ```text output ```` right after it (only blank lines between) is compared line by line with what
the command printed (its stdout, then its stderr), trailing spaces dropped, at a terminal width of 120 columns.
Any other block is shown, not run: mark only commands that take seconds on two CPU cores (CI runs them all in a
few minutes).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from loom import config_reference

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "RESULTS.md"]
FENCE = re.compile(r"^(`{3,})(.*)$")
TIMEOUT_S = 300


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    info: str  # the fence's info string, e.g. "bash cpu exit=2"
    text: str
    output: str | None = None  # the ```text output block right after it, if any

    @property
    def runnable(self) -> bool:
        words = self.info.split()
        return len(words) >= 2 and words[0] == "bash" and words[1] == "cpu"

    @property
    def exit_code(self) -> int:
        m = re.search(r"\bexit=(\d+)\b", self.info)
        return int(m.group(1)) if m else 0

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of a markdown page, each output block attached to the command before it."""
    lines = page.read_text().splitlines()
    found: list[Block] = []
    i, last_end = 0, -2
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, info, start = m.group(1), m.group(2).strip(), i
        i += 1
        body = []
        while i < len(lines) and not lines[i].startswith(fence):
            body.append(lines[i])
            i += 1
        text = "\n".join(body) + "\n"
        if info == "text output":
            between = lines[last_end + 1:start]
            assert found and not any(s.strip() for s in between), (
                f"{page.relative_to(ROOT)}:{start + 1}: a ```text output block must follow its command's block")
            found[-1].output = text
        else:
            found.append(Block(page, start + 1, info, text))
        last_end = i
        i += 1
    return found


def runnable_blocks() -> list[Block]:
    return [b for page in PAGES for b in blocks(page) if b.runnable]


def _normalise(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


@pytest.mark.parametrize("block", runnable_blocks(), ids=lambda b: b.name)
def test_cpu_command_runs_as_written(block: Block, tmp_path):
    for name in ("configs", "examples"):  # copies: a config's ../runs must land in tmp_path, not in the repository
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "loom").symlink_to(ROOT / "loom")  # loom/default.toml
    bin_dir = tmp_path / ".bin"
    bin_dir.mkdir()
    (bin_dir / "loom").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m loom "$@"\n')
    (bin_dir / "loom").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}"
                                 f"{os.environ.get('PATH', '')}",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
           "COLUMNS": "120", "OMP_NUM_THREADS": "1"}
    run = subprocess.run(["bash", "-euo", "pipefail", "-c", block.text], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=TIMEOUT_S)
    said = (f"{block.name}: ```{block.info}\n{block.text}```\n"
            f"stdout:\n{run.stdout[-4000:]}\nstderr:\n{run.stderr[-4000:]}")
    assert run.returncode == block.exit_code, f"exit {run.returncode}, expected {block.exit_code}\n" + said
    if block.output is not None:
        assert _normalise(run.stdout + run.stderr) == _normalise(block.output), "the page shows another output\n" + said


def test_every_page_marks_its_blocks_consistently():
    """A ```bash cpu block's marker is the whole info string's start; a typo (```bash  cpux, ```sh cpu) would
    leave a command shown but never run."""
    odd = [b.name + f" ({b.info})" for page in PAGES for b in blocks(page)
           if "cpu" in b.info and not b.runnable]
    assert not odd, "blocks that look marked but are not runnable: " + ", ".join(odd)


def test_the_doc_commands_are_collected():
    """The README's picture of a layout is one of them, and a page with an exit code other than 0 too."""
    names = {b.page.name for b in runnable_blocks()}
    assert "README.md" in names and len(runnable_blocks()) >= 5
    assert any(b.exit_code for b in runnable_blocks())


LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(page: Path) -> set[str]:
    heads = [line.lstrip("#").strip() for line in _prose(page).splitlines() if line.startswith("#")]
    return {config_reference.anchor(h.replace("`", "")) for h in heads}


def _prose(page: Path) -> str:
    """The page without its fenced blocks (a `# comment` in a bash block is no heading)."""
    out, inside = [], None
    for line in page.read_text().splitlines():
        m = FENCE.match(line)
        if m and (inside is None or line.startswith(inside)):
            inside = None if inside else m.group(1)
            continue
        if inside is None:
            out.append(line)
    return "\n".join(out)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path):
    broken = []
    for target in LINK.findall(_prose(page)):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest})")
        elif fragment and dest.suffix == ".md" and fragment not in _anchors(dest):
            broken.append(f"{target} (no heading #{fragment} in {dest.relative_to(ROOT)})")
    assert not broken, f"{page.relative_to(ROOT)}: broken links: " + "; ".join(broken)


def test_config_reference_is_current():
    committed = (ROOT / "docs" / "config.md").read_text()
    assert committed == config_reference.render(), (
        "docs/config.md differs from the config dataclasses' field comments: run "
        "`python -m loom.config_reference docs/config.md` and commit the result")


def test_config_reference_reads_comments_above_and_beside(tmp_path):
    source = tmp_path / "cfgmod.py"
    source.write_text("from dataclasses import dataclass\n\n@dataclass\nclass C:\n    # above, line one\n"
                      "    # line two\n    a: int = 1  # beside\n\n    # not a's\n\n    b: str = 'x'\n    c: int = 2\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import cfgmod
        assert config_reference.field_comments(cfgmod.C) == {"a": "above, line one line two beside", "b": "",
                                                              "c": ""}
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("cfgmod", None)


def test_readme_stays_a_front_page():
    """README.md is the front page (issue 52): what loom is, the two commands, a layout, what works, the current
    figures, where to go next; a feature's detail belongs in its guide under docs/."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines: move the detail into a guide under docs/"
    test_command = 'pip install torch==2.13.0 && pip install -e ".[test]" && python -m pytest tests'
    assert test_command in lines, ".ci/run runs README's test command verbatim: keep it on a line of its own"
    assert test_command in (ROOT / ".ci" / "run").read_text()


def _section(text: str, heading: str) -> str:
    """The lines under `## heading` up to the next `## `."""
    out, inside = [], False
    for line in text.splitlines():
        if line.startswith("## "):
            inside = line[3:].strip() == heading
        elif inside:
            out.append(line)
    return "\n".join(out)


def test_readme_figures_come_from_the_results_table():
    """Every figure and date in README's "Current figures" stands in bench/RESULTS.md's opening table, where each
    has its device, command and section: README invents none and drops none's provenance."""
    readme = _section((ROOT / "README.md").read_text(), "Current figures")
    results = _section((ROOT / "bench" / "RESULTS.md").read_text(), "Current figures")
    assert readme.count("\n| ") >= 3 and results.count("\n| ") >= 3, "a Current figures table is missing"
    rows = [line for line in readme.splitlines() if line.startswith("| ") and not line.startswith("| ---")][1:]
    token = re.compile(r"\d[\d,.]*(?:×|%)|\d{1,3}(?:,\d{3})+|20\d\d-\d\d-\d\d")
    missing = [f"{t} ({row.split('|')[1].strip()})" for row in rows for t in token.findall(row)
               if t not in results]
    assert not missing, "README figures not in bench/RESULTS.md's Current figures: " + "; ".join(missing)
