#!/usr/bin/env bash
# Pipeline parallelism on 4 GPUs, the 2B workload (eager, bf16), every row with the same samples per step
# (24 per step, --seq 8192) and the same LLM bin capacity (M·T·replicas = 64K tokens), so step times compare:
#   bubble:     pp4 1F1B at m = 4, 8, 16 (bubble vs (p−1)/(m+p−1))
#   layouts:    pp4 interleaved (v = 2) at m = 8, pp2·dp2 vs dp4 on the same data
#   gradreduce: pp2·dp2 1F1B m = 8, parallel.pp_grad_reduce = step vs microbatch (FSDP2 reduce-scatter once
#               per step, unsharded gradients held; or after every microbatch, sharded, 8× the traffic)
#   bash bench/run_pipeline.sh OUT.jsonl [bubble|layouts|gradreduce|all]
# T scales with SEQ (T = SEQ/2 · … · 2·SEQ); EXTRA=--small SEQ=256 STEPS=1 WARMUP=1 is the CPU form CI runs.
set -u
out=$1; part=${2:-all}; steps=${STEPS:-6}; warmup=${WARMUP:-2}; seq=${SEQ:-8192}
extra=${EXTRA:-}
export PYTHONPATH=${PYTHONPATH:-.} NCCL_NVLS_ENABLE=0
run() {  # untied head: the recorded rows were taken before a tie across stages was built
  torchrun --standalone --nproc-per-node=4 bench/mm_bench.py --steps "$steps" --warmup "$warmup" --seq "$seq" \
    $extra --set model.language.tie_embeddings=false "$@" 2>>"$out.err" | grep '^{' >>"$out" || echo "failed: $*" >&2
}
pp() {  # pp, schedule, virtual stages, m, T, then any further mm_bench arguments
  local p=$1 schedule=$2 v=$3 m=$4 t=$5; shift 5
  run --set layout.language.pp=$p --set parallel.pp_schedule=$schedule --set parallel.pp_virtual_stages=$v \
    --set train.microbatches=$m --set data.tokens_per_microbatch=$t "$@"
}
want() { [ "$part" = all ] || [ "$part" = "$1" ]; }
if want bubble; then
  pp 4 1f1b 1 4 $((seq * 2))
  pp 4 1f1b 1 8 $seq
  pp 4 1f1b 1 16 $((seq / 2))
fi
if want layouts; then
  pp 4 interleaved_1f1b 2 8 $seq
  pp 2 1f1b 1 4 $seq
  run --set train.microbatches=2 --set data.tokens_per_microbatch=$seq
fi
if want gradreduce; then
  for reduce in step microbatch; do
    pp 2 1f1b 1 8 $((seq / 2)) --set parallel.pp_grad_reduce=$reduce
  done
fi
