#!/usr/bin/env bash
# The several-GPU rows of issue 47 in one GPU call: the 2B step on 1 GPU (CUDA graphs, its best) and on N GPUs
# (plain compiled: graphs are refused under FSDP2), each from the tree named, one JSON line per row appended to
# OUT/rows.jsonl, tagged with its tree and spec.
#   bash bench/run_scale.sh OUT "SPEC..."     SPEC = TREE:GPUS:T[:KEY=VALUE,KEY=VALUE...]
# GPUS = 1xN: N one-GPU runs at once, one per GPU (what one GPU gives when the machine's others are busy too:
# power and clocks shared), one line each.
# e.g. "before:4:16384 after:4:16384 after:4:16384:parallel.fsdp_prefetch=2 after:1:16384"
# EXTRA: more mm_bench arguments for every row (--small: the CPU form).
# STEPS (default 8) timed steps after WARMUP (3); LIMIT: seconds a row may take (default 240). The word
# `profile` among a spec's KEY=VALUEs adds --profile and --timeline on every rank (files under OUT); `env:NAME=V`
# sets an environment variable for that row alone (e.g. env:NCCL_PROTO=Simple); `arg:--FLAG=V` passes an mm_bench
# argument (e.g. arg:--samples-of=4: a one-GPU row carrying a 4-GPU row's samples).
set -u
mkdir -p "$1"; out=$(cd "$1" && pwd); specs=$2; steps=${STEPS:-8}; warmup=${WARMUP:-3}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
run_row() {  # TREE SPEC DEVICES LAUNCH...: one mm_bench run, its JSON line tagged and appended to rows.jsonl
  local tree=$1 spec=$2 devices=$3; shift 3
  (cd "$tree" && env "${envs[@]}" CUDA_VISIBLE_DEVICES="$devices" PYTHONPATH=. timeout "${LIMIT:-240}" \
    "$@" bench/mm_bench.py --seq "$t" --steps "$steps" --warmup "$warmup" "${extra[@]}" ${EXTRA:-} \
    2> >(sed "s|^|[row $n] |" >>"$out/err.log")) | grep '^{' | sed "s|^{|{\"tree\": \"$tree\", \"spec\": \"$spec\", \"devices\": \"$devices\", |" \
    >>"$out/rows.jsonl" || echo "{\"tree\": \"$tree\", \"spec\": \"$spec\", \"failed\": true}" >>"$out/rows.jsonl"
}
n=0
for spec in $specs; do
  IFS=: read -r tree gpus t sets <<<"$spec"
  n=$((n + 1))
  extra=(--set train.compile=true --set "data.tokens_per_microbatch=$t"); envs=()
  [ "${gpus#1x}" = 1 ] || [ "${gpus#1x}" != "$gpus" ] && extra+=(--set train.compile_mode=reduce-overhead)
  for kv in ${sets//,/ }; do
    if [ "${kv#env:}" != "$kv" ]; then
      envs+=("${kv#env:}")
    elif [ "${kv#arg:}" != "$kv" ]; then
      extra+=("${kv#arg:}")
    elif [ "$kv" = profile ]; then  # every rank's profile summary and compute timeline, under OUT
      extra+=(--profile "$out/profile-$n-{rank}.txt" --timeline "$out/timeline-$n-{rank}.json")
    else
      extra+=(--set "$kv")
    fi
  done
  echo "=== row $n: $spec $(date +%T)"
  if [ "${gpus#1x}" != "$gpus" ]; then  # 1xN: N independent one-GPU runs side by side
    for g in $(seq 0 $((${gpus#1x} - 1))); do run_row "$tree" "$spec" "$g" python & done
    wait
  else
    launch=(python)
    [ "$gpus" -gt 1 ] && launch=(torchrun --standalone --nproc-per-node="$gpus")
    run_row "$tree" "$spec" "$(seq -s, 0 $((gpus - 1)))" "${launch[@]}"
  fi
  tail -n "$([ "${gpus#1x}" != "$gpus" ] && echo "${gpus#1x}" || echo 1)" "$out/rows.jsonl" | python3 -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    print({k: r.get(k) for k in ('spec', 'devices', 'tokens_per_s_per_gpu', 'mfu', 'peak_mem_gib', 'step_s', 'step_s_min',
                                 'step_s_max', 'recompiles', 'exposed_comm_share', 'rank_skew', 'failed')})"
done
