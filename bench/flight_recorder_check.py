"""GPU check: a collective that never completes ends with NCCL's flight-recorder dumps in the trace folder.

    torchrun --standalone --nproc-per-node=2 bench/flight_recorder_check.py OUT_DIR

Rank 1 stops answering; rank 0's all-reduce times out after 20 s (`init_distributed`'s timeout), and the
flight recorder loom switches on writes `OUT_DIR/nccl-trace-rank-R`. Prints what each rank saw and the files.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

from loom.distributed import init_distributed


def main() -> None:
    out = sys.argv[1]
    device = init_distributed("nccl", timeout_s=20, trace_dir=out)
    rank = dist.get_rank()
    x = torch.ones(4, device=device)
    dist.all_reduce(x)  # one that completes, so the recorder has history
    torch.cuda.synchronize()
    try:
        if rank == 1:
            time.sleep(60)  # stops answering
        else:
            dist.all_reduce(x)
            torch.cuda.synchronize()
        print(f"rank {rank}: no error", flush=True)
    except Exception as e:  # noqa: BLE001 — reporting what happened is the point
        print(f"rank {rank}: {type(e).__name__}: {str(e).splitlines()[0]}", flush=True)
    time.sleep(10)  # the dump is written by the watchdog thread
    print(f"rank {rank}: {sorted(os.listdir(out))}", flush=True)
    os._exit(0)  # the timed-out communicator cannot be destroyed cleanly


if __name__ == "__main__":
    main()
