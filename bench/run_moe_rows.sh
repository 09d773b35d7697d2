#!/usr/bin/env bash
# The mixture-of-experts rows of issue 49 in one GPU call, each from the tree named, one JSON line per row
# appended to OUT/rows.jsonl, tagged with its tree and spec.
#   bash bench/run_moe_rows.sh OUT "SPEC..."    SPEC = TREE:BENCH:LLM:GPUS:T[:KEY=VALUE,KEY=VALUE...]
# BENCH: mm (bench/mm_bench.py, the LLM after the ViT and audio encoder) or llm (bench/llm_bench.py, text only,
# documents of 4,096 tokens); LLM: a bench/shapes.py name (moe, moe128); T: tokens per GPU per step, one compiled
# microbatch (a spec's own data.tokens_per_microbatch and train.microbatches=M split it: its KEY=VALUEs come last).
# Among a spec's KEY=VALUEs, `eager` drops train.compile and `profile` writes OUT/profile-N.txt.
# e.g. ". :llm:moe128:1:16384:model.language.num_layers=4  .:mm:moe:2:8192:layout.language.ep=2"
# stderr of every row goes to OUT/err.log (a call brings back 8 files at most).
# STEPS (default 6) timed steps after WARMUP (3); LIMIT: seconds a row may take (default 240); DEVICES: the GPUs
# (CUDA_VISIBLE_DEVICES) instead of the first GPUS, e.g. to run one-GPU rows side by side.
set -u
mkdir -p "$1"; out=$(cd "$1" && pwd); specs=$2; steps=${STEPS:-6}; warmup=${WARMUP:-3}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
n=0
for spec in $specs; do
  IFS=: read -r tree bench llm gpus t sets <<<"$spec"
  n=$((n + 1))
  compiled=(--set train.compile=true --set "data.tokens_per_microbatch=$t")
  extra=(--llm "$llm" --steps "$steps" --warmup "$warmup")
  if [ "$bench" = llm ]; then extra+=(--tokens "$t" --seq 4096); else extra+=(--seq "$t"); fi
  for kv in ${sets//,/ }; do
    case $kv in
      eager) compiled=() ;;
      profile) extra+=(--profile "$out/profile-$n.txt") ;;
      *) extra+=(--set "$kv") ;;
    esac
  done
  launch=(python)
  [ "$gpus" -gt 1 ] && launch=(torchrun --standalone --nproc-per-node="$gpus")
  echo "=== row $n: $spec $(date +%T)"
  (cd "$tree" && CUDA_VISIBLE_DEVICES=${DEVICES:-$(seq -s, 0 $((gpus - 1)))} PYTHONPATH=. timeout "${LIMIT:-240}" \
    "${launch[@]}" "bench/${bench}_bench.py" "${compiled[@]}" "${extra[@]}" 2>"$out/err.tmp"; cat "$out/err.tmp" >>"$out/err.log") \
    | grep '^{' | sed "s|^{|{\"tree\": \"$tree\", \"spec\": \"$spec\", |" >>"$out/rows.jsonl" \
    || { echo "{\"tree\": \"$tree\", \"spec\": \"$spec\", \"failed\": true}" >>"$out/rows.jsonl"; tail -3 "$out/err.tmp"; }
  tail -1 "$out/rows.jsonl" | python3 -c "import json,sys; r=json.loads(sys.stdin.read()); print({k: r.get(k) for k in
    ('spec','tokens_per_s','tokens_per_s_per_gpu','mfu','peak_mem_gib','step_s','step_s_min','step_s_max',
     'recompiles','failed')})"
done
