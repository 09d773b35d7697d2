#!/usr/bin/env bash
# The mm_bench table: each contender on the GPU counts given, one JSON line per run appended to OUT.
#   bash bench/run_mm.sh OUT.jsonl "1 4"      (then: python -m bench.table OUT.jsonl)
# Rows: loom packed (compiled and eager), loom padded (to the longest sample and to --seq), the HF baseline;
# on several GPUs also loom heterogeneous and loom with gathered weights kept through backward.
set -u
out=$1; counts=${2:-"1 4"}; steps=${STEPS:-10}; warmup=${WARMUP:-3}; seq=${SEQ:-4096}
extra=${EXTRA:-}  # e.g. --small: the CPU form CI runs
export PYTHONPATH=${PYTHONPATH:-.}
compiled=${COMPILED---set train.compile=true}  # COMPILED="" runs the "compiled" rows eager
run() {
  local n=$1; shift
  CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((n - 1))) torchrun --standalone --nproc-per-node="$n" bench/mm_bench.py \
    --steps "$steps" --warmup "$warmup" --seq "$seq" $extra "$@" 2>>"$out.err" | grep '^{' >>"$out" || echo "failed: $n GPUs $*" >&2
}
for n in $counts; do
  run "$n" --system loom --format thd $compiled
  [ -n "$compiled" ] && run "$n" --system loom --format thd  # eager beside compiled (COMPILED="": the same row)
  run "$n" --system loom --format bshd $compiled
  run "$n" --system loom --format bshd --pad-to seq $compiled
  run "$n" --system hf
  if [ "$n" -gt 1 ]; then
    run "$n" --system loom --layout heterogeneous --format thd $compiled
    run "$n" --system loom --format thd $compiled --set parallel.reshard_after_forward=false
  fi
done
