#!/usr/bin/env bash
# Per-GPU memory of the LLM's FSDP2 layout under cp, on 4 GPUs at dp2·cp2 (bench/cp_long.py, ~0.4B LLM, bf16):
# "hsdp" (sharded over cp, replicated over dp: loom before dp×cp flattening) vs "flat" (sharded over dp×cp),
# at 32K tokens per replica (the cp table's size) and 8K (activations smaller, so the weights' share shows).
#   bash bench/run_fsdp_cp.sh OUT.jsonl
set -u
out=$1; steps=${STEPS:-6}; warmup=${WARMUP:-2}; gpus=${GPUS:-4}
extra=${EXTRA:-}  # e.g. --small: a CPU smoke run
export PYTHONPATH=${PYTHONPATH:-.} NCCL_NVLS_ENABLE=0
for seq in ${SEQS:-32768 8192}; do
  for fsdp in hsdp flat; do
    torchrun --standalone --nproc-per-node="$gpus" bench/cp_long.py --cp 2 --seq "$seq" --fsdp "$fsdp" \
      --steps "$steps" --warmup "$warmup" $extra 2>>"$out.err" | grep '^{' >>"$out" || echo "failed: seq $seq $fsdp" >&2
  done
done
