#!/usr/bin/env bash
# Colocated vs non-colocated placement on GPUS GPUs (2 or 4), the same samples per step for every row (eager,
# bf16, packed): the 2B workload (1.5B LLM, one image per sample) and an encoder-heavy one (0.5B LLM after the
# same 0.4B ViT, IMAGES images per sample, 6 samples per GPU in 3·SEQ tokens), each colocated (every module data parallel on every GPU) and
# non-colocated (the encoders on the first ENC GPUs, the LLM data parallel on the rest), M microbatches per
# LLM replica (6·GPUS samples per step: M = 2 divides them for LLM dp 1-4), so the encoders' microbatch i + 1
# overlaps the LLM's microbatch i. PROFILE=1 writes per-rank
# profiler summaries and device timelines next to OUT, and for each non-colocated row one line of
# OUT.overlap.jsonl (bench/overlap.py: how long the encoder GPUs and the LLM GPUs were busy at the same time).
#   bash bench/run_noncolocated.sh OUT.jsonl
# EXTRA=--small SEQ=256 STEPS=1 WARMUP=1 GPUS=2 is the CPU form CI runs.
set -u
out=$1; steps=${STEPS:-6}; warmup=${WARMUP:-2}; seq=${SEQ:-8192}; gpus=${GPUS:-4}; m=${M:-2}
images=${IMAGES:-4}; extra=${EXTRA:-}
export PYTHONPATH=${PYTHONPATH:-.} NCCL_NVLS_ENABLE=0
run() {  # a later --seq wins
  timeout "${ROW_TIMEOUT:-300}" torchrun --standalone --nproc-per-node="$gpus" bench/mm_bench.py --steps "$steps" --warmup "$warmup" --seq "$seq" \
    $extra "$@" 2>>"$out.err" | grep '^{' >>"$out" || echo "failed: $*" >&2
}
placed() {  # ENC encoder GPUs, a row name, then mm_bench arguments
  local enc=$1 name=$2; shift 2
  run --set layout.vision.ranks=0-$((enc - 1)) --set layout.audio.ranks=0-$((enc - 1)) \
    --set layout.language.ranks=$enc-$((gpus - 1)) --set train.microbatches=$m "$@" $(profile "$name")
  [ -n "${PROFILE:-}" ] && python -m bench.overlap --label "$name" --group encoders=0-$((enc - 1)) --group llm=$enc-$((gpus - 1)) \
    "$out.$name".timeline.rank*.json >>"$out.overlap.jsonl"
}
profile() { [ -n "${PROFILE:-}" ] && echo "--profile $out.$1.rank{rank}.txt --timeline $out.$1.timeline.rank{rank}.json"; }
for workload in "--llm 1.5b --images 1 --per-gpu 6" "--llm 0.5b --images $images --per-gpu 6 --seq $((seq * 3))"; do
  name=$(echo $workload | tr -d ' -')
  run $workload --set train.microbatches=$m $(profile colocated-$name)
  placed $((gpus / 2)) noncolocated-half-$name $workload
  [ "$gpus" -gt 2 ] && placed 1 noncolocated-one-$name $workload
done
