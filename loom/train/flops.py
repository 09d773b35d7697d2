"""The model's training FLOPs for a step's real (non-padding) tokens, and the MFU they make (PaLM's definition:
throughput times the model's FLOPs per token, over the peak).

Per module, per token: 6 · (parameters of its matrix multiplies) — forward 2, backward 4 — which counts
every linear layer (the LM head included on every token, as the model defines it, though a step computes the
head only at its targets: data/batch.py `target_rows`; the embedding lookup excluded) and the patch / conv stems
as the matmuls they are. Plus attention scores and their weighting, per sample of length L and per layer with
width d = heads · head_dim (under multi-head latent attention, the mean of the key and value widths): forward
4·L²·d bidirectional, 2·L²·d causal (half the pairs); training 3× that.
Padding is never counted: a padded step pays for its pads in time, and its MFU shows it. The trainer's log
line and bench/ count with this one function.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loom.models.sizes import matmul_params


def attention_forward_flops(lengths: list[int], layers: int, width: int, causal: bool) -> float:
    """The forward's scores and weighting: 4·L²·d per layer bidirectional, 2·L²·d causal (half the pairs)."""
    return squares_forward_flops(sum(n * n for n in lengths), layers, width, causal)


def squares_forward_flops(squares: int, layers: int, width: int, causal: bool) -> float:
    """`attention_forward_flops` from the lengths' squares, summed."""
    per_pair = 2 if causal else 4
    return per_pair * layers * width * squares


def attention_flops(lengths: list[int], layers: int, width: int, causal: bool) -> float:
    """Training's, as MFU counts them: 3× the forward (a kernel that recomputes in backward does more)."""
    return 3.0 * attention_forward_flops(lengths, layers, width, causal)


def squares_flops(squares: int, layers: int, width: int, causal: bool) -> float:
    """`attention_flops` from the lengths' squares, summed."""
    return 3.0 * squares_forward_flops(squares, layers, width, causal)


def step_flops(llm_params: int, llm_layers: int, llm_width: int, llm_lengths: list[int],
               encoders: list[tuple[int, int, int, list[int]]]) -> float:
    """encoders: (matmul params incl. projector, layers, width, tokens per item) for each encoder."""
    total = 6.0 * llm_params * sum(llm_lengths) + attention_flops(llm_lengths, llm_layers, llm_width, True)
    for params, layers, width, items in encoders:
        total += 6.0 * params * sum(items) + attention_flops(items, layers, width, False)
    return total


@dataclass(frozen=True)
class ModelFlops:
    """A model's sizes as the FLOP count reads them: (matmul params, layers, attention width) per module,
    taken from the whole model before any layout splits it."""

    llm: tuple[int, int, int]
    encoders: dict[str, tuple[int, int, int]]

    @staticmethod
    def of(model) -> ModelFlops:
        lm = model.language.cfg
        encoders = {}
        for name in model.encoder_names:
            enc = model.encoder(name)
            encoders[name] = (matmul_params(enc), enc.encoder.cfg.num_layers, enc.encoder.cfg.hidden_size)
        # a pair's scores read key_dim and its sum value_dim per head: their mean is the width (MLA: 192, 128)
        width = lm.num_heads * (lm.key_dim + lm.value_dim) // 2
        return ModelFlops((matmul_params(model.language), lm.num_layers, width), encoders)

    def step(self, llm_lengths: list[int], item_rows: dict[str, list[int]]) -> float:
        """Training FLOPs of a step: real tokens per sample, and each encoder's rows per item."""
        return step_flops(*self.llm, llm_lengths, [(*self.encoders[n], rows) for n, rows in item_rows.items()])

    def of_sums(self, tokens: int, token_squares: int, rows: dict[str, tuple[int, int]]) -> float:
        """`step` from sums alone (a step's totals, train/step_totals.py): the real tokens and their squares per
        sample, and each encoder's item rows and their squares — the same number, no list of the global batch."""
        params, layers, width = self.llm
        total = 6.0 * params * tokens + squares_flops(token_squares, layers, width, True)
        for name, (n, squares) in rows.items():
            params, layers, width = self.encoders[name]
            total += 6.0 * params * n + squares_flops(squares, layers, width, False)
        return total


def peak_matmul_tflops(device: torch.device) -> float:
    """What an 8192³ bf16 matmul reaches on `device` (TFLOP/s; nan off CUDA): MFU's denominator, measured, so the
    figure holds on any GPU (datasheet peaks are about 25% above what a matmul reaches on an H200)."""
    if device.type != "cuda":
        return float("nan")
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        a @ b
    end.record()
    torch.cuda.synchronize(device)
    return 2 * 8192**3 * 10 / (start.elapsed_time(end) / 1e3) / 1e12
