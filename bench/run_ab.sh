#!/usr/bin/env bash
# Before/after rows of issue 33 in one GPU call: each row run from every tree given, in turn, so ratios come from
# one machine. One JSON line per row appended to OUT/rows.jsonl, tagged with the tree and the row.
#   bash bench/run_ab.sh OUT "TREE..." "ROW..."    e.g. "before after" "llm:8192 mm:16384"
# Rows: llm:T (the LLM alone, one T-token microbatch of 8,192-token documents, cuDNN SDPA, plain compiled, as the
# torchtitan comparison), mm:T (the 2B multimodal step, CUDA graphs: round 4's best), mmplain:T (plain compiled).
# EXTRA adds overrides to every row; STEPS: timed steps (default 10 llm, 8 mm).
set -u
out=$1; trees=$2; rows=$3; extra=${EXTRA:-}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
for spec in $rows; do
  kind=${spec%%:*}; t=${spec#*:}
  case $kind in
    llm) cmd="python bench/llm_bench.py --tokens $t --steps ${STEPS:-10} --warmup 3 --busy 3 --set train.compile=true
           --set model.attention=sdpa" ;;
    mm) cmd="python bench/mm_bench.py --seq $t --steps ${STEPS:-8} --warmup 3 --busy 3 --set train.compile=true
          --set data.tokens_per_microbatch=$t --set train.compile_mode=reduce-overhead" ;;
    mmplain) cmd="python bench/mm_bench.py --seq $t --steps ${STEPS:-8} --warmup 3 --busy 3 --set train.compile=true
          --set data.tokens_per_microbatch=$t" ;;
  esac
  for tree in $trees; do
    echo "=== $tree $spec $(date +%T)"
    (cd "$tree" && PYTHONPATH=. timeout "${LIMIT:-240}" $cmd $extra 2>>"$out/err-$tree.log") | grep '^{' \
      | sed "s/^{/{\"tree\": \"$tree\", \"row\": \"$spec\", /" >>"$out/rows.jsonl" \
      || echo "{\"tree\": \"$tree\", \"row\": \"$spec\", \"failed\": true}" >>"$out/rows.jsonl"
    tail -1 "$out/rows.jsonl" | python3 -c "import json,sys; r=json.loads(sys.stdin.read()); print({k: r.get(k) for k in
      ('tree','row','tokens_per_s','tokens_per_s_per_gpu','mfu','peak_mem_gib','step_s','step_s_min','step_s_max',
       'recompiles','busy','failed')})"
  done
done
