#!/usr/bin/env bash
# Packed vs padded at the same samples per step, both fixed-shape and compiled, on 1 GPU: loom thd (every
# microbatch T = SEQ tokens) against loom bshd (rows of the workload's longest possible sample, encoder row
# budget R·S by default, then the packed run's T); one JSON line per run.
#   bash bench/run_padded.sh OUT.jsonl      (then: python -m bench.table OUT.jsonl)
set -u
out=$1; seq=${SEQ:-8192}; steps=${STEPS:-10}; warmup=${WARMUP:-3}
extra=${EXTRA:-}
export PYTHONPATH=${PYTHONPATH:-.} NCCL_NVLS_ENABLE=0
run() {
  timeout "${RUN_TIMEOUT:-280}" torchrun --standalone --nproc-per-node=1 bench/mm_bench.py --steps "$steps" \
    --warmup "$warmup" --seq "$seq" --set train.compile=true $extra "$@" 2>>"$out.err" | grep '^{' >>"$out" \
    || echo "failed: $*" >&2
}
run --system loom --format thd --set "data.tokens_per_microbatch=$seq"
run --system loom --format bshd
run --system loom --format bshd --set "data.encoder_rows_per_microbatch={vision = $seq, audio = $seq}"
