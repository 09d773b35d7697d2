"""The FLOP count lives in loom (loom/train/flops.py: the trainer's log line reads it too); bench/ keeps these names,
and `flops_of`, a workload's count that mm_bench.py's two contenders share (here, not in mm_bench.py: no cycle)."""

from loom.train.flops import attention_flops, matmul_params, peak_matmul_tflops, step_flops

__all__ = ["attention_flops", "flops_of", "matmul_params", "peak_matmul_tflops", "step_flops"]


def flops_of(samples, spec: dict) -> float:
    """Training FLOPs of `samples` (`step_flops`); `spec` holds the modules' matmul sizes and depths."""
    patch = spec["patch"]
    patches = spec.get("patches_per_image") or None
    items = [patches or (i.shape[-2] // patch) * (i.shape[-1] // patch) for s in samples for i in s.images]
    frames = [(c.shape[-1] + 1) // 2 for s in samples for c in s.audio] if spec.get("audio") else []
    lengths = [spec["llm_length"](s) for s in samples]
    encoders = [(*spec["vision"], items)] + ([(*spec["audio"], frames)] if spec.get("audio") else [])
    return step_flops(*spec["llm"], lengths, encoders)
