"""Long-sequence context-parallel benchmark: one packed 32K-token sample per LLM replica, cp ∈ {1, 2, 4}.

Run on a GPU machine (one process per GPU), once per cp degree, side by side:
    torchrun --nproc-per-node=4 bench/cp_long.py --cp 1 --seq 32768
    torchrun --nproc-per-node=4 bench/cp_long.py --cp 2 --seq 32768
    torchrun --nproc-per-node=4 bench/cp_long.py --cp 4 --seq 32768
Each prints one JSON line (rank 0): real tokens/s per GPU, step time, peak memory per GPU, and the bytes of
weights and AdamW moments this GPU holds. With one sample per replica, cp spreads each sample's tokens (and
their activations) over cp GPUs. `--fsdp hsdp` restores the LLM's FSDP2 layout before dp×cp flattening
(sharded over cp, replicated over dp) for memory comparisons; see bench/run_fsdp_cp.sh.
Runs on CPU too (gloo, fp32, SDPA) with small sizes, which is how CI keeps it from rotting.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from loom.bridge.replica_rows import ReplicaRows
from loom.data.packing import pack_samples
from loom.data.sample import Sample
from loom.distributed import init_distributed, shutdown
from loom.job import load_config
from loom.train.build import build_job
from loom.train.inputs import StepInputs
from loom.train.optim import ModuleOptimizers

# a ~0.4B-parameter Llama-shaped LLM; the encoders stay tiny (text-only samples: they run one dummy item)
LLM = ["--model.language.hidden_size=1024", "--model.language.num_layers=16", "--model.language.num_heads=16",
       "--model.language.num_kv_heads=4", "--model.language.intermediate_size=4096",
       "--model.language.vocab_size=32768", "--model.language.tie_embeddings=false"]
SMALL_LLM = ["--model.language.hidden_size=64", "--model.language.num_layers=2", "--model.language.num_heads=4",
             "--model.language.num_kv_heads=2", "--model.language.intermediate_size=128"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--small", action="store_true", help="tiny model, for a CPU smoke run")
    p.add_argument("--fsdp", choices=["flat", "hsdp"], default="flat",
                   help="the LLM's FSDP2 mesh under cp: dp×cp flattened (loom's), or (dp, cp) HSDP (loom's before)")
    args = p.parse_args()
    if args.fsdp == "hsdp":
        replicate_over_dp()
    device = init_distributed("auto")
    world = dist.get_world_size() if dist.is_initialized() else 1
    gpu = device.type == "cuda"
    dp = world // args.cp
    cfg = load_config(None, (SMALL_LLM if args.small else LLM) + [
        f"--layout.language.cp={args.cp}", f"--data.pad_to_multiple={2 * args.cp}",
        # one sample per LLM replica: the encoders get as many replicas (split the rest by tp)
        f"--layout.vision.tp={args.cp}", f"--layout.audio.tp={args.cp}",
        f"--train.global_batch_size={dp}", f"--train.dtype={'bf16' if gpu else 'fp32'}",
        "--train.grad_clip=1.0", "--data.train_size=64", "--data.heldout_size=1",
    ], world_size=world)
    job = build_job(cfg, device)  # its data goes unused: the step below is one synthetic sample per replica
    cfg, tok, model, plan, optimizer = job.cfg, job.tok, job.model, job.plan, job.optimizer
    g = torch.Generator().manual_seed(plan.shares["language"][0])
    ids = torch.randint(0, 256, (args.seq,), generator=g).tolist()  # one sample: this replica's share
    batch = pack_samples([Sample(ids, [False] + [True] * (args.seq - 1), [], [])], tok.pad_id, 2 * args.cp)
    inputs = StepInputs.of(batch.to(device), tokens=args.seq)
    inputs.supervised *= dp  # every replica holds one such sample
    inputs.microbatches[0].rows = {n: ReplicaRows([0] * plan.shares[n][1], [0] * dp) for n in model.encoder_names}
    times = []
    for step in range(args.warmup + args.steps):
        if gpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        result = plan.train_step(model, optimizer, inputs, cfg, step)
        if gpu:
            torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    step_s = sorted(times)[len(times) // 2]
    state_gib = local_state_bytes(model, optimizer) / 2**30
    allocated = torch.cuda.memory_allocated(device) / 2**30 if gpu else float("nan")
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if gpu else float("nan")
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(json.dumps({
            "bench": "cp_long", "cp": args.cp, "dp": dp, "gpus": world, "seq": args.seq, "fsdp": args.fsdp,
            "device": torch.cuda.get_device_name(device) if gpu else "cpu", "torch": torch.__version__,
            "step_s": round(step_s, 4), "tokens_per_s_per_gpu": round(args.seq * dp / step_s / world, 1),
            "peak_mem_gib": round(peak, 2), "allocated_after_step_gib": round(allocated, 2),
            "weights_and_moments_gib": round(state_gib, 4), "loss": round(result.loss, 4),
        }))
    shutdown()


def replicate_over_dp() -> None:
    """Bench only: the LLM's FSDP2 mesh as before dp×cp flattening — (dp, cp), i.e. HSDP: sharded over cp,
    replicated over dp — so that memory can be compared on the same code otherwise."""
    import loom.parallel.fsdp

    def hsdp_mesh(grid, device_type):
        return grid.mesh(*(("dp", "cp") if grid.layout.cp > 1 else ("dp",)), device_type=device_type)

    loom.parallel.fsdp.fsdp_mesh = hsdp_mesh


def local_state_bytes(model: torch.nn.Module, optimizer: ModuleOptimizers) -> int:
    """Bytes of this rank's weight shards and AdamW moments (gradients are freed after each step)."""
    local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
    tensors = [*model.parameters(), *(v for st in optimizer.state.values() for v in st.values()
                                      if isinstance(v, torch.Tensor) and v.ndim > 0)]
    return sum(local(t).numel() * local(t).element_size() for t in tensors)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown after collectives (it sometimes aborts a rank at exit)
