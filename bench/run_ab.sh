#!/usr/bin/env bash
# Before/after rows of issue 33 in one GPU call: each row run from every tree given, in turn, so ratios come from
# one machine. One JSON line per row appended to OUT/rows.jsonl, tagged with the tree and the row.
#   bash bench/run_ab.sh OUT "TREE..." "ROW..."    e.g. "before after" "llm:8192 mm:16384"
# Rows: llm:T (the LLM alone, one T-token microbatch of 8,192-token documents, cuDNN SDPA, plain compiled, as the
# torchtitan comparison), mm:T (the 2B multimodal step, CUDA graphs: round 4's best), mmplain:T (plain compiled).
# EXTRA adds overrides to every row; STEPS: timed steps (default 10 llm, 8 mm). WARM=ROW first runs that row once
# from the first tree, unrecorded: a fresh machine's first row runs slow (bench/RESULTS.md, round 8).
set -u
out=$1; trees=$2; rows=$3; extra=${EXTRA:-}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0

row_command() {  # the command of row spec $1 with $2 timed steps
  local kind=${1%%:*} t=${1#*:}
  case $kind in
    llm) echo "python bench/llm_bench.py --tokens $t --steps ${2:-10} --warmup 3 --busy 3 --set train.compile=true
           --set model.attention=sdpa" ;;
    mm) echo "python bench/mm_bench.py --seq $t --steps ${2:-8} --warmup 3 --busy 3 --set train.compile=true
          --set data.tokens_per_microbatch=$t --set train.compile_mode=reduce-overhead" ;;
    mmplain) echo "python bench/mm_bench.py --seq $t --steps ${2:-8} --warmup 3 --busy 3 --set train.compile=true
          --set data.tokens_per_microbatch=$t" ;;
  esac
}

if [ -n "${WARM:-}" ]; then
  first=${trees%% *}
  echo "=== warm-up row $first $WARM $(date +%T)"
  (cd "$first" && PYTHONPATH=. timeout "${LIMIT:-240}" $(row_command "$WARM" 3) $extra >/dev/null 2>>"$out/err-warm.log")
fi
for spec in $rows; do
  cmd=$(row_command "$spec" "${STEPS:-}")
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
