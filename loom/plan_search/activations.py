"""What a step keeps on the GPU for backward, per token, as loom's eager layers save it — the memory side of the
cost model (cost.py's `activations` and `logits` terms). The elementwise *time* term keeps Korthikanti et al.'s
count (`activation_bytes_per_token_layer`): the calibrated elementwise rate is measured against that count.

Per token and layer, eager, no checkpointing (autograd's saved tensors, each storage once; checked against
`torch.autograd.graph.saved_tensors_hooks` on loom's own layers in tests/test_plan_activations.py):
- each of the two norms: RMSNorm (the LLM's) normalises in fp32 and keeps its fp32 input (4 bytes a unit of
  width), the normalised value the weight multiplies (dtype) and its rstd (4 bytes a token); LayerNorm (the
  towers') keeps its input (dtype) and mean + rstd (8 bytes);
- the two projections' inputs (the norms' outputs: dtype each);
- q, k and v as the attention kernel reads them; at tp = 1 the three come from one fused matmul (layers.project)
  and v's view keeps the whole output alive, so a decoder whose rotary (and qk-norm) makes new q and k keeps
  those beside it (att + kv more); qk-norm keeps its fp32 inputs and normalised values as RMSNorm does;
- the attention output and FlashAttention's log-sum-exp (fp32, a head);
- the MLP's `mlp_tensors` × width (SwiGLU: gate, silu(gate), up, their product; GELU: fc1's output, the GELU's).
Selective checkpointing (parallel/checkpointing.py) keeps the block's input and the outputs of its matmuls and
attention kernel; full keeps the block's input. Compiled blocks (train.compile): inductor's partitioner recomputes
the norms and rotary in backward, so the count is Korthikanti's (not measured here).

The LM head and loss at their peak, per head row and vocabulary entry (the loss's backward, every layer's
activations still held): eager (train/loss.py token_loss_sum) the logits in the step's dtype (the runner holds
them through backward), log-softmax's fp32 output, its incoming gradient and the gradient it makes: dtype + 12
bytes (14 in bf16: measured on an H200, bench/results/2026-11-29-saved-bytes-h200.jsonl); compiled, the fp32 pass
is fused: the logits and their gradient, 2 × dtype.
"""

from __future__ import annotations

from typing import Any

ModuleSizes = Any  # cost.ModuleSizes (which imports this module): its widths, norm and MLP kind

RSTD_BYTES = 4  # RMSNorm's fp32 rstd a token; LayerNorm's mean and rstd twice that
LSE_BYTES = 4  # FlashAttention's log-sum-exp, fp32, a head and token


def heads(m: ModuleSizes) -> int:
    return max(1, m.attention_width * m.kv_heads // max(1, m.kv_width))


def activation_bytes_per_token_layer(m: ModuleSizes, tp: int, dtype_bytes: int, sequence_parallel: bool = False,
                                     checkpointing: str = "none") -> float:
    """Activations a layer keeps for backward, per token (the estimate of Korthikanti et al. 2022, with flash
    attention's O(L) memory): the norms' and projections' inputs (4 × hidden: split over tp only under sequence
    parallel), q, k, v and the attention output (split over tp; K/V heads replicated when tp > KV heads), and
    the MLP's `mlp_tensors` × width (split over tp). Full checkpointing keeps only the block's input."""
    if checkpointing == "full":
        return m.hidden * dtype_bytes / (tp if sequence_parallel else 1)
    replicated = 4 * m.hidden / (tp if sequence_parallel else 1)
    kv = 2 * m.kv_width / min(tp, m.kv_heads)
    split = (2 * m.attention_width) / tp + kv + m.mlp_tensors * m.mlp_width / tp
    return (replicated + split) * dtype_bytes


def _norm_bytes(m: ModuleSizes, dtype_bytes: int) -> float:
    """One of the block's norms, per unit of width (and the per-token extras folded in per width)."""
    if m.norm_fp32:  # RMSNorm: fp32 input, the normalised value in dtype, rstd
        return (4 + dtype_bytes) * m.hidden + RSTD_BYTES
    return dtype_bytes * m.hidden + 2 * RSTD_BYTES  # LayerNorm: its input, mean and rstd


def saved_bytes_per_token_layer(m: ModuleSizes, tp: int, dtype_bytes: int, sequence_parallel: bool = False,
                                checkpointing: str = "none", compiled: bool = False) -> float:
    """Bytes one layer keeps for backward per token on a rank with tensor parallel degree `tp` (the module
    docstring's count). Widths are split over tp (K/V heads over min(tp, kv_heads)); the norms' region over tp
    only under sequence parallel."""
    seq = tp if sequence_parallel else 1
    if checkpointing == "full":
        return m.hidden * dtype_bytes / seq
    if compiled and checkpointing == "none":
        return activation_bytes_per_token_layer(m, tp, dtype_bytes, sequence_parallel)
    att, kv = m.attention_width / tp, m.kv_width / min(tp, m.kv_heads)
    mlp = m.mlp_width / tp
    lse = heads(m) / tp * LSE_BYTES
    if checkpointing == "selective":  # the input; q, k, v and the attention's output (+ lse); the MLP's matmul
        # outputs (SwiGLU: gate and up; GELU: fc1) and the two row-parallel outputs (o_proj, down)
        return (m.hidden / seq + att + 2 * kv + att + m.mlp_tensors / 2 * mlp + 2 * m.hidden / seq) * dtype_bytes + lse
    norms = 2 * _norm_bytes(m, dtype_bytes) / seq
    inputs = 2 * m.hidden * dtype_bytes / seq  # the norms' outputs, into the q/k/v and MLP projections
    qkv = att + 2 * kv  # as the kernel reads them (v's view holds the fused output at tp = 1)
    if m.causal and tp == 1:  # rotary's new q and k beside the fused output
        qkv += att + kv
    if m.qk_norm:  # fp32 inputs and normalised values of q and k
        qkv += (att + kv) * (4 + dtype_bytes) / dtype_bytes
    return norms + inputs + (qkv + att + m.mlp_tensors * mlp) * dtype_bytes + lse


def head_bytes_per_row(vocab: int, tp: int, dtype_bytes: int, compiled_loss: bool) -> float:
    """The LM head and loss's peak per head row (module docstring), the vocabulary split over tp."""
    per_entry = 2 * dtype_bytes if compiled_loss else dtype_bytes + 3 * 4
    return per_entry * vocab / tp
