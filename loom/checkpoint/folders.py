"""Crash-safe checkpoint folders in a run's out_dir: written under a temporary name, published by a rename.

  out_dir/step-N.tmp/   being written (a crash leaves it; the next save of step N replaces it)
  out_dir/step-N/       complete: renamed only after every rank's files and state.json are written
  out_dir/latest        "step-N", written (atomically) after the rename: the checkpoint `run.resume = "auto"`
                        continues from

`run.keep_last = K` removes all but the K newest complete checkpoints, only after a newer one is published.
Only rank 0 touches names; the other ranks wait at a barrier, so every rank sees the same folders after.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from loom.checkpoint.sharded import STATE_FILE, CheckpointError

LATEST = "latest"
_STEP = re.compile(r"^step-(\d+)$")


def staging_dir(out_dir: str | Path, step: int) -> Path:
    """Where step N's checkpoint is written before it is published."""
    return Path(out_dir) / f"step-{step}.tmp"


def clear_staging(out_dir: str | Path, step: int) -> None:
    """Rank 0, before a save: files a crashed earlier try at step N left behind go."""
    shutil.rmtree(staging_dir(out_dir, step), ignore_errors=True)


def publish(out_dir: str | Path, step: int, keep_last: int) -> Path:
    """Rank 0 only: step N's staging folder becomes step-N, `latest` names it, then older ones beyond
    `keep_last` (0: keep all) go."""
    out = Path(out_dir)
    final = out / f"step-{step}"
    if final.exists():  # a re-run of the same step (resumed from an earlier one): the new one wins
        shutil.rmtree(final)
    os.replace(staging_dir(out, step), final)
    marker = out / (LATEST + ".tmp")
    marker.write_text(final.name + "\n")
    os.replace(marker, out / LATEST)  # atomic: a reader sees the old marker or the new one
    if keep_last > 0:
        for old in complete_checkpoints(out)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def complete_checkpoints(out_dir: str | Path) -> list[Path]:
    """Published step-N folders, oldest first."""
    out = Path(out_dir)
    if not out.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in out.iterdir() if (m := _STEP.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The checkpoint `latest` names, or None when the run has none yet. A marker that points nowhere is an
    error (it never does after a clean publish; someone removed the folder)."""
    out = Path(out_dir)
    marker = out / LATEST
    if not marker.is_file():
        return None
    target = out / marker.read_text().strip()
    if not (target / STATE_FILE).is_file():
        raise CheckpointError(f"{marker} names {target.name}, which is not a complete checkpoint in {out} "
                              f"(complete ones: {[p.name for p in complete_checkpoints(out)] or 'none'})")
    return target


def resume_path(resume: str, out_dir: str | Path) -> Path | None:
    """`run.resume`: "" starts fresh, "auto" continues from out_dir's latest checkpoint (fresh if none),
    anything else is a checkpoint folder."""
    if not resume:
        return None
    if resume == "auto":
        return latest_checkpoint(out_dir)
    path = Path(resume)
    if not path.is_dir():
        raise CheckpointError(f"run.resume = {resume!r}: no such checkpoint folder")
    return path
