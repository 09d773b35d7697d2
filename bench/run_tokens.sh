#!/usr/bin/env bash
# Fixed-shape microbatches: loom (compiled, every microbatch exactly T tokens) at T = 4096, 8192, 16384 per
# GPU against the HF contender at the same tokens per GPU, on the GPU counts given; one JSON line per run.
#   bash bench/run_tokens.sh OUT.jsonl "1 4"      (then: python -m bench.table OUT.jsonl)
# T = 16384 runs with activation checkpointing ("full": selective does not compose with compile).
set -u
out=$1; counts=${2:-"1 4"}; steps=${STEPS:-10}; warmup=${WARMUP:-3}; budgets=${BUDGETS:-"4096 8192 16384"}
extra=${EXTRA:-}
export PYTHONPATH=${PYTHONPATH:-.}
run() {
  local n=$1; shift
  CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((n - 1))) torchrun --standalone --nproc-per-node="$n" bench/mm_bench.py \
    --steps "$steps" --warmup "$warmup" $extra "$@" 2>>"$out.err" | grep '^{' >>"$out" || echo "failed: $n GPUs $*" >&2
}
for n in $counts; do
  for t in $budgets; do
    ac=none; [ "$t" -ge 16384 ] && ac=full
    run "$n" --system loom --format thd --seq "$t" --set train.compile=true --set "data.tokens_per_microbatch=$t" \
      --set "train.activation_checkpointing=$ac"
    run "$n" --system hf --seq "$t"
  done
done
