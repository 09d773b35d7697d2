#!/usr/bin/env bash
# Start-up memory on 4 GPUs, the 2B workload's model: this loom against an older one, two rounds alternating.
#   git archive <old commit> loom | tar -x -C OLD_DIR      # the older loom, e.g. f46726c (before the meta build)
#   OLD=OLD_DIR bash bench/run_startup.sh OUT.jsonl
# Without OLD only this loom is measured.
set -u
out=$1; old=${OLD:-}
export PYTHONPATH=${PYTHONPATH:-.} NCCL_NVLS_ENABLE=0
run() { torchrun --standalone --nproc-per-node=4 bench/startup.py 2>>"$out.err" | grep '^{' >>"$out" || echo "failed" >&2; }
for round in 1 2; do
  run
  [ -n "$old" ] && PYTHONPATH="$old:$PYTHONPATH" run
done
