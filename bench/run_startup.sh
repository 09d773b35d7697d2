#!/usr/bin/env bash
# Start-up memory on 4 GPUs, the 2B workload's model (bench/startup.py), two rounds.
#   bash bench/run_startup.sh OUT.jsonl
set -u
out=$1
export PYTHONPATH=${PYTHONPATH:-.} NCCL_NVLS_ENABLE=0
run() { torchrun --standalone --nproc-per-node=4 bench/startup.py 2>>"$out.err" | grep '^{' >>"$out" || echo "failed" >&2; }
for round in 1 2; do
  run
done
