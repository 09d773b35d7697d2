"""A second run of the same compiled job must still equal the reference.

On torch 2.13 a compiled TP + SP block restored from AOTAutograd's on-disk cache gave gradients 1% off
(the forward and loss exact) while a fresh compile was exact; loom turns that cache off when it compiles.
The fast test checks that switch. The behavioural one — two `loom verify` processes on tp2 + SP sharing an
inductor cache, the second failing on the grad norm with the cache on (checked 2026-11-22) — takes 150 s of
cold compiles on CI's two cores, so it runs with LOOM_SLOW_TESTS=1.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch._functorch.config
import torch.nn as nn

from loom.parallel.compile import compile_blocks

LAYOUT = ["--train.global_batch_size=16", "--data.train_size=2000", "--train.compile=true",
          "--layout.vision.tp=1", "--layout.language.tp=2", "--layout.language.sequence_parallel=true",
          "--data.pad_to_multiple=2"]


class _OneBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleDict({"0": nn.Linear(2, 2)})


def test_compiling_turns_off_the_autograd_cache(monkeypatch):
    monkeypatch.setattr(torch._functorch.config, "enable_autograd_cache", True)
    compile_blocks("language", _OneBlock())
    assert torch._functorch.config.enable_autograd_cache is False


@pytest.mark.skipif(not os.environ.get("LOOM_SLOW_TESTS"), reason="150 s of cold compiles: LOOM_SLOW_TESTS=1")
def test_second_compiled_run_matches_the_reference(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "loom",
           "verify", "configs/tiny.toml", *LAYOUT]
    for run in ("first", "second"):
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        assert out.returncode == 0, f"{run} run: {out.stdout[-3000:]}{out.stderr[-3000:]}"
        assert out.stdout.count("PASS") == 3, f"{run} run: {out.stdout[-3000:]}"
