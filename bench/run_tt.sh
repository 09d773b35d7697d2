#!/usr/bin/env bash
# torchtitan v0.2.2's Qwen3-1.7B on NGPU GPUs of one host (FSDP over them), the anchor's command
# (../shared/anchors/torchtitan-qwen3.md), at each TOKENS per GPU (a multiple of 8192): one JSON line per row
# (bench/titan_log.py: its per-GPU `tps` from step 10 on and their median) printed and appended to OUT, its log in
# OUT.tt-NGPU-TOKENS.log. Needs the kit in .tt/ (tt/: the source tree, whl/: its extra wheels; not committed), so
# the device call carries it: carry=[".tt"].
#   bash bench/run_tt.sh OUT.jsonl 4 8192 16384
set -u
[ $# -ge 3 ] || { echo "usage: bash bench/run_tt.sh OUT NGPU TOKENS_PER_GPU..." >&2; exit 2; }
out=$(realpath -m "$1"); ngpu=$2; shift 2
cd "$(dirname "$0")/.."
kit=${TT_KIT:-.tt}; site=${TT_SITE:-/tmp/site}
export NCCL_NVLS_ENABLE=0  # NVLink multicast off on the lent machines (the device notes say why)
export PYTHONPATH=${PYTHONPATH:-.}
if [ ! -f "$site/.tt-wheels" ]; then  # once per machine: a second call finds them
  pip install --quiet --no-index --no-deps --target "$site" "$kit"/whl/*.whl && touch "$site/.tt-wheels" \
    || { echo "failed: installing $kit/whl into $site" >&2; exit 1; }
fi
status=0
for tokens in "$@"; do
  log="$out.tt-$ngpu-$tokens.log"
  (cd "$kit/tt" && PYTHONPATH="$site:." NGPU=$ngpu CONFIG_FILE=./torchtitan/models/qwen3/train_configs/qwen3_1.7b.toml \
    ./run_train.sh --model.hf_assets_path ./tests/assets/tokenizer --training.dataset c4_test \
    --training.seq_len 8192 --training.local_batch_size $((tokens / 8192)) --compile.enable \
    --activation_checkpoint.mode none --training.steps 25 --metrics.log_freq 5 --lr_scheduler.warmup_steps 2) \
    >"$log" 2>&1 || { echo "failed: torchtitan $ngpu x $tokens (see $log)" >&2; status=1; }
  python -m bench.titan_log "$log" --gpus "$ngpu" --tokens-per-gpu "$tokens" | tee -a "$out"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done
exit $status
