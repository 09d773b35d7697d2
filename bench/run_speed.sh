#!/usr/bin/env bash
# One GPU call of issue 33's rows, before/after in the same call: the 2B multimodal step at T (profiled once,
# then timed with plain compiled blocks and with CUDA-graphed ones), the LLM alone likewise, each row with the
# GPU's busy fraction by CUDA events (--busy). One JSON line per row appended to OUT/rows.jsonl.
#   bash bench/run_speed.sh OUT [T]     ROWS="mm hf llm attn gputest" picks parts; STEPS: mm steps timed; EXTRA adds overrides to every row
set -u
out=$1; t=${2:-8192}; rows=${ROWS:-mm llm}; extra=${EXTRA:-}
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
compiled="--set train.compile=true --set data.tokens_per_microbatch=$t"
row() {  # a row that fails or outlives its limit leaves a line saying so, and the call goes on
  local name=$1; shift
  echo "=== $name $(date +%T)"
  timeout "${LIMIT:-240}" "$@" 2>>"$out/err.log" | grep '^{' | sed "s/^{/{\"row\": \"$name\", /" >>"$out/rows.jsonl" \
    || echo "{\"row\": \"$name\", \"failed\": true}" >>"$out/rows.jsonl"
  tail -1 "$out/rows.jsonl" | cut -c1-400
}
for part in $rows; do
  case $part in
    mm)
      [ -n "${PROFILE-x}" ] && row mm-profile python bench/mm_bench.py --seq "$t" --steps 4 --warmup 3 $compiled $extra \
        ${PROFILE:-} --profile "$out/mm-profile-$t.txt"  # PROFILE="--set ..." profiles that variant, PROFILE= none
      row mm-plain python bench/mm_bench.py --seq "$t" --steps "${STEPS:-8}" --warmup 3 --busy 3 $compiled $extra
      row mm-graphs python bench/mm_bench.py --seq "$t" --steps "${STEPS:-8}" --warmup 3 --busy 3 $compiled $extra \
        --set train.compile_mode=reduce-overhead ;;
    llm)
      row llm-plain python bench/llm_bench.py --tokens "$t" --steps 10 --warmup 3 --busy 3 --set train.compile=true \
        --set model.attention=sdpa $extra
      row llm-graphs python bench/llm_bench.py --tokens "$t" --steps 10 --warmup 3 --busy 3 --set train.compile=true \
        --set model.attention=sdpa --set train.compile_mode=reduce-overhead $extra ;;
    hf)
      row hf torchrun --standalone --nproc-per-node=1 bench/mm_bench.py --system hf --seq "$t" --steps 8 --warmup 3 ;;
    attn)
      timeout 300 python bench/attn_impl.py ${FA4:+--fa4} 2>>"$out/err.log" | tee -a "$out/attn.jsonl" ;;
    gputest)
      timeout 300 python -m pytest -x -q -p no:cacheprovider tests/test_gpu_step.py 2>&1 | tail -15 ;;
  esac
done
