#!/usr/bin/env bash
# The several-GPU comparison in one GPU call (bench/RESULTS.md, 2026-11-27): the 2B step on 1 GPU (CUDA graphs)
# and dp4 (plain compiled) at T = 16,384 and 8,192, the LLM alone against torchtitan v0.2.2 at 8,192 and 16,384
# tokens per GPU, then the HF + FSDP2 contender. Rows from TREE (a `git archive` of the commit measured).
#   bash bench/run_dp4_rows.sh OUT TREE      (torchtitan needs the .tt kit: carry it; bench/run_tt.sh)
set -u
mkdir -p "$1"; out=$(cd "$1" && pwd); tree=$2; here=$PWD
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
four=(torchrun --standalone --nproc-per-node=4)
STEPS=1 WARMUP=1 LIMIT=120 bash bench/run_scale.sh "$out/warm" "$tree:4:16384" >/dev/null  # a fresh machine's first row
EXTRA=--comm-report LIMIT=120 bash bench/run_scale.sh "$out" "$tree:1:16384 $tree:4:16384 $tree:1:8192 $tree:4:8192"
for per_gpu in 8192 16384; do
  (cd "$tree" && PYTHONPATH=. timeout 120 "${four[@]}" bench/llm_bench.py --tokens $((4 * per_gpu)) --steps 10 \
    --warmup 3 --set train.compile=true --set model.attention=sdpa --set "data.tokens_per_microbatch=$per_gpu" \
    --comm-report 2>>"$out/err-llm-$per_gpu.log") | grep '^{' | head -1 | tee -a "$out/llm.jsonl" | cut -c1-400
  (cd "$here" && timeout 150 bash bench/run_tt.sh "$out/tt.jsonl" 4 "$per_gpu" | tail -1)
done
(cd "$tree" && PYTHONPATH=. timeout 150 "${four[@]}" bench/mm_bench.py --system hf --seq 8192 --steps 8 --warmup 3 \
  2>>"$out/err-hf.log") | grep '^{' | tee -a "$out/hf.jsonl" | cut -c1-400
