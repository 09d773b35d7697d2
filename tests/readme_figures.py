"""The documented figures that CI checks. docs/training.md's table of the documented runs' figures ("Determinism
and the figures' spread") gives each run's short form — its first steps, bit for bit the full run's — with the band
its loss at the last of them lands in over seeds, thread counts and machines. The tests read the band from that page
itself, so the page and the code cannot drift apart unnoticed."""

from __future__ import annotations

import re
from pathlib import Path

FIGURES = Path(__file__).resolve().parent.parent / "docs" / "training.md"


def short_form_band(run: str) -> tuple[int, float, float]:
    """(steps, low, high) of docs/training.md's row whose first cell is `run` (a command in backticks): its short
    form `--train.steps=N` and the band "loss at step N: low–high"."""
    for line in FIGURES.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0] == f"`{run}`":
            m = re.search(r"`--train\.steps=(\d+)`: loss at step (\d+) ([0-9.]+)–([0-9.]+)", line)
            assert m and m.group(1) == m.group(2), f"docs/training.md's row for {run} has no short form's band: {line}"
            return int(m.group(1)), float(m.group(3)), float(m.group(4))
    raise AssertionError(f"docs/training.md has no figures row for `{run}`")
