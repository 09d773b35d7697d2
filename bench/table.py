"""Markdown table of mm_bench JSON lines (bench/run_mm.sh's output): python -m bench.table RUNS.jsonl"""

from __future__ import annotations

import json
import sys


def label(r: dict) -> str:
    if r["system"] == "hf":
        return "HF Llava + FSDP2, padded to longest"
    what = "packed (THD)" if r["format"] == "thd" else f"padded to {r.get('pad_to') or 'longest'}"
    extras = list(r["overrides"]) + (["foreach AdamW"] if r.get("adam") == "foreach" else [])
    return f"loom {r['layout']}, {what}" + (f" [{', '.join(extras)}]" if extras else "")


def main(path: str) -> None:
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.startswith("{")]
    print("| GPUs | seq | contender | tokens/s per GPU | TFLOP/s per GPU | MFU | peak memory (GiB) | padding "
          "| step (s) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "–"
        print(f"| {r['gpus']} | {r['seq']} | {label(r)} | {r['tokens_per_s_per_gpu']:,.0f} "
              f"| {r['tflops_per_gpu']} | {mfu} "
              f"| {r['peak_mem_gib']} | {r['padding_fraction']:.1%} | {r['step_s']} |")


if __name__ == "__main__":
    main(sys.argv[1])
