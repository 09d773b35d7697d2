"""Issue 49, target 1 on GPUs: `loom verify` with the experts split over every GPU (ep = world), compiled by
inductor (grouped GEMM, bf16), and every token routed to experts 0 and 1 — EP rank 0's — by a large choice bias
set at start-up on both sides: the other ranks receive no token in any step, and the experts past 1 none
anywhere. The CPU test (tests/test_compiled_ep.py) runs the same case under aot_eager; this one runs inductor's
CUDA code, where the unpadded kernel crashed.

    torchrun --standalone --nproc-per-node=2 bench/ep_idle_gpu.py

Prints one JSON line (rank 0): each step's verdict and the largest relative differences.
"""

from __future__ import annotations

import io
import json

import torch
import torch.distributed as dist
from rich.console import Console

from loom.distributed import init_distributed, shutdown
from loom.job import load_config
from loom.models.router import Router
from loom.train.verify import verify

MOE = ["--model.language.num_layers=3", "--model.language.hidden_size=256", "--model.language.intermediate_size=512",
       "--model.language.num_experts=8", "--model.language.num_experts_per_tok=2",
       "--model.language.moe_intermediate_size=128", "--model.language.mlp_only_layers=[0]",
       "--model.language.router_bias=true", "--model.language.router_bias_update_rate=0",
       "--model.language.expert_kernel=grouped", "--train.global_batch_size=16", "--data.train_size=2000"]


def _skewed(reset):
    def skewed(self):
        reset(self)
        if self.e_score_correction_bias is not None:
            self.e_score_correction_bias[:2] = 100.0
    return skewed


def main() -> None:
    device = init_distributed("auto")
    world = dist.get_world_size()
    Router.reset_buffers = _skewed(Router.reset_buffers)
    smoke = [] if device.type == "cuda" else ["--train.compile_backend=aot_eager"]  # CPU: a quick smoke run
    cfg = load_config(None, MOE + smoke + [f"--layout.language.ep={world}", "--train.dtype=bf16",
                                           "--train.compile=true", f"--train.device={device.type}"], world_size=world)
    checks = verify(cfg, steps=2, device=device, console=Console(file=io.StringIO()))
    if dist.get_rank() == 0:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        print(json.dumps({"bench": "ep_idle_gpu", "ep": world, "device": name,
                          "torch": torch.__version__, "passed": [c.passed for c in checks],
                          "failures": [c.failures for c in checks],
                          "quantities": [c.quantities() for c in checks]}, default=str))
    shutdown()


if __name__ == "__main__":
    main()
