"""The FLOP count lives in loom (loom/train/flops.py: the trainer's log line reads it too); bench/ keeps these names."""

from loom.train.flops import attention_flops, matmul_params, peak_matmul_tflops, step_flops

__all__ = ["attention_flops", "matmul_params", "peak_matmul_tflops", "step_flops"]
