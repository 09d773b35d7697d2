#!/usr/bin/env bash
# The mixture-of-experts rows on one GPU, one JSON line each appended to OUT: one MoE block's kernels alone
# (grouped GEMM against the per-expert loop, bench/moe_kernels.py), then the Qwen3-MoE-shaped LLM with the ViT
# (bench/mm_bench.py --llm moe): grouped GEMM eager, the loop eager, grouped GEMM compiled.
#   bash bench/run_moe.sh OUT.jsonl            (then: python -m bench.table OUT.jsonl)
set -u
out=$1; steps=${STEPS:-6}; warmup=${WARMUP:-2}; seq=${SEQ:-4096}
extra=${EXTRA:-}  # e.g. EXTRA="--set model.language.num_layers=16": the shape that fits an H100's 80 GB
export PYTHONPATH=${PYTHONPATH:-.}
python bench/moe_kernels.py --tokens "$seq" --hidden 2048 --inter 1408 --experts 16 --top-k 2 \
  2>>"$out.err" | grep '^{' >>"$out" || echo "failed: moe_kernels" >&2
row() {
  python bench/mm_bench.py --llm moe --steps "$steps" --warmup "$warmup" --seq "$seq" $extra "$@" \
    2>>"$out.err" | grep '^{' >>"$out" || echo "failed: mm_bench --llm moe $*" >&2
}
row
row --set model.language.expert_kernel=loop
row --set train.compile=true --set data.tokens_per_microbatch="$seq"
