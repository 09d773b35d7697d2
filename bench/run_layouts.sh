#!/usr/bin/env bash
# Issue 51: one workload's rows in one GPU call (bench/layout_workloads.py: its one-layout alternatives and loom's
# per-module layouts, the same samples for every row), each row followed by `loom verify` of its layout (fp32, 3
# steps, NCCL on GPUs; the workload's verify model, whose one-process reference fits one GPU). One JSON line per
# bench row and one per verify, appended to OUT/rows.jsonl; each row's stderr in OUT/err-WORKLOAD-ROW.log.
#   bash bench/run_layouts.sh OUT WORKLOAD [ROW ...]       WORKLOAD: long-context | pipelined | encoder-heavy
# ROWs default to all of the workload's. GPUS (4), STEPS (8) timed after WARMUP (3), LIMIT seconds per row (300),
# COMPILE (1: train.compile=true), VERIFY (1: loom verify after each row; loom: after loom's rows only; 0: none),
# EXTRA: more mm_bench arguments.
# Pipelined rows add --stage-timing (each rank's bubble against (p−1)/(m+p−1)); encoder-heavy rows --comm-report
# (idle_share_per_rank: 1 − each GPU's kernel time per step / the step, the encoder GPUs' idle share).
# SMALL=1 is the CPU form CI runs: --small, 2 gloo ranks, 1 step after 1, eager.
set -u
mkdir -p "$1"; out=$(cd "$1" && pwd); workload=$2; shift 2
small=()
if [ -n "${SMALL:-}" ]; then
  small=(--small); : "${GPUS:=2}" "${STEPS:=1}" "${WARMUP:=1}" "${COMPILE:=0}"
fi
gpus=${GPUS:-4}; steps=${STEPS:-8}; warmup=${WARMUP:-3}
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
rows=("$@")
[ ${#rows[@]} -gt 0 ] || mapfile -t rows < <(python -m bench.layout_workloads rows "$workload" "${small[@]}")
[ ${#rows[@]} -gt 0 ] || { echo "no rows for workload $workload" >&2; exit 2; }
status=0
for row in "${rows[@]}"; do
  extra=()
  [ "${COMPILE:-1}" = 1 ] && extra+=(--set train.compile=true)
  [ "$workload" = pipelined ] && extra+=(--stage-timing)
  [ "$workload" = encoder-heavy ] && extra+=(--comm-report)  # each GPU's compute per step: the encoder GPUs' idle
  log="$out/err-$workload-$row.log"
  echo "=== $workload $row $(date +%T)"
  timeout "${LIMIT:-300}" torchrun --standalone --nproc-per-node="$gpus" bench/mm_bench.py --workload "$workload" \
    --layout "$row" --steps "$steps" --warmup "$warmup" "${small[@]}" "${extra[@]}" ${EXTRA:-} 2>>"$log" \
    | grep '^{' | sed "s|^{|{\"row\": \"$row\", |" >>"$out/rows.jsonl" \
    || { echo "{\"workload\": \"$workload\", \"row\": \"$row\", \"failed\": true}" >>"$out/rows.jsonl"; status=1; }
  tail -1 "$out/rows.jsonl" | python3 -c "import json,sys; r=json.loads(sys.stdin.read()); print({k: r.get(k) for k in
    ('row','tokens_per_s_per_gpu','step_s','step_s_min','step_s_max','peak_mem_gib','recompiles','idle_share_per_rank',
     'failed')})"
  case "${VERIFY:-1}" in 1) ;; loom) [[ $row == loom-* ]] || continue ;; *) continue ;; esac
  mapfile -t verify < <(python -m bench.layout_workloads verify "$workload" "$row" "${small[@]}")
  timeout "${LIMIT:-300}" torchrun --standalone --nproc-per-node="$gpus" -m loom verify configs/tiny.toml --steps=3 \
    "${verify[@]}" >>"$log" 2>&1
  rc=$?
  [ $rc = 0 ] || status=1
  echo "{\"workload\": \"$workload\", \"row\": \"$row\", \"verify\": \"$([ $rc = 0 ] && echo passed || echo failed)\", \"rc\": $rc, \"gpus\": $gpus}" \
    | tee -a "$out/rows.jsonl"
done
exit $status
