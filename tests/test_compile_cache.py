"""A second run of the same compiled job must still equal the reference.

On torch 2.13 a compiled TP + SP block restored from AOTAutograd's on-disk cache gave gradients 1% off
(the forward and loss exact) while a fresh compile was exact; loom turns that cache off. The second run is
a new process, as a restarted job is: only then is the on-disk cache read. Two ranks (tp2 + SP) show it:
with the cache on, the second run fails on the grad norm (checked 2026-11-22).
"""

from __future__ import annotations

import os
import subprocess
import sys

LAYOUT = ["--train.global_batch_size=16", "--data.train_size=2000", "--train.compile=true",
          "--layout.vision.tp=1", "--layout.language.tp=2", "--layout.language.sequence_parallel=true",
          "--data.pad_to_multiple=2"]


def test_second_compiled_run_matches_the_reference(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "loom",
           "verify", "configs/tiny.toml", *LAYOUT]
    for run in ("first", "second"):
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        assert out.returncode == 0, f"{run} run: {out.stdout[-3000:]}{out.stderr[-3000:]}"
        assert out.stdout.count("PASS") == 3, f"{run} run: {out.stdout[-3000:]}"
