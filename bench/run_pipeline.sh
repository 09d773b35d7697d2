#!/usr/bin/env bash
# Pipeline parallelism on 4 GPUs, the 2B workload (eager, bf16), every row with the same samples per step
# (24 per step, --seq 8192) and the same LLM bin capacity (M·T·replicas = 64K tokens), so step times compare:
#   pp4 1F1B at m = 4, 8, 16 (bubble vs (p−1)/(m+p−1)), pp4 interleaved (v = 2) at m = 8,
#   pp2·dp2 vs dp4 on the same data.
#   bash bench/run_pipeline.sh OUT.jsonl [bubble|layouts|all]
set -u
out=$1; part=${2:-all}; steps=${STEPS:-6}; warmup=${WARMUP:-2}
export PYTHONPATH=${PYTHONPATH:-.} NCCL_NVLS_ENABLE=0
run() {
  torchrun --standalone --nproc-per-node=4 bench/mm_bench.py --steps "$steps" --warmup "$warmup" --seq 8192 \
    --set model.language.tie_embeddings=false "$@" 2>>"$out.err" | grep '^{' >>"$out" || echo "failed: $*" >&2
}
pp() {  # pp, schedule, virtual stages, m, T
  run --set layout.language.pp=$1 --set parallel.pp_schedule=$2 --set parallel.pp_virtual_stages=$3 \
    --set train.microbatches=$4 --set data.tokens_per_microbatch=$5
}
if [ "$part" != layouts ]; then
  pp 4 1f1b 1 4 16384
  pp 4 1f1b 1 8 8192
  pp 4 1f1b 1 16 4096
fi
if [ "$part" != bubble ]; then
  pp 4 interleaved_1f1b 2 8 8192
  pp 2 1f1b 1 4 8192
  run --set train.microbatches=2 --set data.tokens_per_microbatch=8192
fi
