#!/usr/bin/env bash
# The LLM-alone rows on one GPU: loom (bench/llm_bench.py, compiled) at 8,192 and 16,384 tokens per step, one
# JSON line each appended to OUT; with TT=DIR (a torchtitan v0.2.2 tree, ../shared/anchors/torchtitan-qwen3.md)
# torchtitan's Qwen3-1.7B at the same tokens per step in the same call, its log in OUT.tt-N.log (TT_SITE: a folder
# of torchtitan's extra packages, put first on its PYTHONPATH).
#   bash bench/run_llm.sh OUT.jsonl            EXTRA="--set KEY=VALUE" adds a loom override to every row
set -u
# one long document per microbatch: cuDNN's SDPA per sample beats varlen there (bench/RESULTS.md)
out=$1; steps=${STEPS:-10}; warmup=${WARMUP:-3}; extra=${EXTRA---set model.attention=sdpa}
export PYTHONPATH=${PYTHONPATH:-.}
for tokens in 8192 16384; do
  python bench/llm_bench.py --tokens "$tokens" --steps "$steps" --warmup "$warmup" --busy 3 --set train.compile=true $extra \
    2>>"$out.err" | grep '^{' >>"$out" || echo "failed: loom $tokens" >&2
  if [ -n "${TT:-}" ]; then
    (cd "$TT" && PYTHONPATH="${TT_SITE:+$TT_SITE:}." NGPU=1 CONFIG_FILE=./torchtitan/models/qwen3/train_configs/qwen3_1.7b.toml ./run_train.sh \
      --model.hf_assets_path ./tests/assets/tokenizer --training.dataset c4_test --training.seq_len 8192 \
      --training.local_batch_size $((tokens / 8192)) --compile.enable --activation_checkpoint.mode none \
      --training.steps 25 --metrics.log_freq 5 --lr_scheduler.warmup_steps 2) >"$out.tt-$tokens.log" 2>&1 \
      || echo "failed: torchtitan $tokens" >&2
  fi
done
