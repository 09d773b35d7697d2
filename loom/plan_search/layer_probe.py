"""loom's own layers timed for the calibration (calibrate.py): the LLM's decoder layer and the encoders' layer at a
reference shape, forward + backward, eager, in the step's dtype (bf16 on CUDA, as FSDP2's unsharded weights).

- On a handful of tokens their arithmetic is negligible: the time is the host's per layer (and its forward's
  share), of the real op sequence — RMSNorm's seven kernels, rotary, biases — where a generic block has fewer.
- Attention, loom's own `attend` (FlashAttention 2 varlen on CUDA, SDPA per sample on CPU): the decoder's on one
  long causal sample, the encoder's on image-sized items, FLOPs counted as executed (3.5× the forward).
- On many tokens (device-bound on a GPU) the time beyond the matmuls (at the measured matmul rate) and the
  attention (timed alone at the same shape) is what the elementwise kernels take; over the activation bytes the
  cost model counts for the layer (cost.activation_bytes_per_token_layer: written, read, their gradient) it is
  the rate those kernels reach. Eager kernels move more than the count (RMSNorm normalises in fp32, each op reads
  and writes its operands whole), so it sits below a copy's; it is never taken above `memory_bytes_per_s`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from loom.data.spans import TokenSpans
from loom.model_config import LLMConfig
from loom.models.attention import attend
from loom.models.encoder_layer import EncoderLayer
from loom.models.layers import Rotary
from loom.models.llm import DecoderLayer
from loom.plan_search.calibration import LayerFacts
from loom.plan_search.cost import FLASH_BACKWARD, ModuleSizes, activation_bytes_per_token_layer
from loom.train.flops import attention_forward_flops

# reference shapes, (CUDA, CPU): a Qwen2-like decoder layer (GQA, q/k/v bias, SwiGLU 4×) and SigLIP-so400m's encoder
# layer (LayerNorm, tanh GELU, heads of 72); each (hidden, heads, kv heads, mlp, items, rows per item)
SHAPES = {"decoder": ((1024, 8, 2, 4096, 64, 1024), (128, 4, 2, 512, 4, 256)),
          "encoder": ((1152, 16, 16, 4304, 112, 576), (128, 4, 4, 512, 8, 64))}
LONG = (16384, 1024)  # the decoder's attention rate: one causal sample this long
FEW = 16  # the host-bound run's tokens


def reference_sizes(kind: str, device: torch.device) -> ModuleSizes:
    """One reference layer as the cost model sees it."""
    hidden, heads, kv_heads, mlp, _, _ = SHAPES[kind][device.type != "cuda"]
    d = hidden // heads
    decoder = kind == "decoder"
    params = (hidden * (heads + 2 * kv_heads) * d + heads * d * hidden + 3 * hidden * mlp if decoder
              else 4 * hidden * hidden + 2 * hidden * mlp)
    return ModuleSizes(kind, params, 0, params, 1, hidden, heads * d, kv_heads * d, kv_heads, mlp,
                       4 if decoder else 2, decoder)


def _runner(kind: str, device: torch.device, dtype: torch.dtype) -> Callable[..., None]:
    """`run(rows, items, forward_only=False)`: the reference layer over `items` samples of `rows` tokens."""
    hidden, heads, kv_heads, mlp, _, _ = SHAPES[kind][device.type != "cuda"]
    if kind == "decoder":
        cfg = LLMConfig(hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads, intermediate_size=mlp,
                        attention_bias=True)
        layer, rotary = DecoderLayer(cfg).to(device, dtype), Rotary(cfg.rope_dim, cfg.rope_theta).to(device)

        def forward(x, rows, items, spans):
            return layer(x, rotary(torch.arange(rows, device=device).repeat(items), dtype, 1), spans)
    else:
        layer = EncoderLayer(hidden, heads, mlp, 1e-6, "tanh").to(device, dtype)

        def forward(x, rows, items, spans):
            return layer(x, spans)

    inputs = {}  # made once per shape, as a step makes its spans once for every layer

    def run(rows: int, items: int, forward_only: bool = False) -> None:
        if (rows, items) not in inputs:
            inputs[rows, items] = (torch.randn(rows * items, hidden, device=device, dtype=dtype, requires_grad=True),
                                   TokenSpans.from_lengths([rows] * items, device))
        x, spans = inputs[rows, items]
        out = forward(x, rows, items, spans)
        if not forward_only:
            out.sum().backward()

    return run


def median_seconds(fn: Callable[[], None], repeats: int, sync: Callable[[], None]) -> float:
    """Median seconds of `fn` over `repeats` calls after one warm-up (`sync`: waits for the device)."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _attention_s(sizes: ModuleSizes, rows: int, items: int, device: torch.device, dtype: torch.dtype,
                 repeats: int, sync) -> float:
    """`attend`'s forward + backward over `items` samples of `rows` at the layer's heads (causal: a decoder's)."""
    heads, d = sizes.attention_width * sizes.kv_heads // sizes.kv_width, sizes.kv_width // sizes.kv_heads
    q = torch.randn(rows * items, heads, d, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(rows * items, sizes.kv_heads, d, device=device, dtype=dtype, requires_grad=True)
            for _ in range(2))
    grad, spans = torch.randn_like(q), TokenSpans.from_lengths([rows] * items, device)
    return median_seconds(lambda: attend(q, k, v, spans, sizes.causal).backward(grad), repeats, sync)


def _executed(sizes: ModuleSizes, rows: int, items: int) -> float:
    return attention_forward_flops([rows] * items, 1, sizes.attention_width, sizes.causal) * (1 + FLASH_BACKWARD)


def time_layer(kind: str, device: torch.device, repeats: int, sync: Callable[[], None], matmul_flops_per_s: float,
               memory_bytes_per_s: float) -> LayerFacts:
    """`kind` ("decoder" or "encoder") timed as the module docstring says."""
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    sizes, run = reference_sizes(kind, device), _runner(kind, device, dtype)
    host = median_seconds(lambda: run(FEW, 1), repeats * 3, sync)
    forward = median_seconds(lambda: run(FEW, 1, forward_only=True), repeats * 3, sync)
    *_, items, rows = SHAPES[kind][not cuda]
    whole = median_seconds(lambda: run(rows, items), repeats, sync)
    attention = _attention_s(sizes, rows, items, device, dtype, repeats, sync)
    matmuls = 6.0 * sizes.matmul_params * rows * items / matmul_flops_per_s
    left = whole - matmuls - attention - (0.0 if cuda else host)  # on a CPU the host's time is the device's too
    counted = 3 * activation_bytes_per_token_layer(sizes, 1, 2 if cuda else 4) * rows * items
    elementwise = min(memory_bytes_per_s, counted / left) if left > 0 else memory_bytes_per_s
    if kind == "decoder":  # the LLM's attention rate on one long sample (long context is where it weighs)
        long = LONG[not cuda]
        rate = _executed(sizes, long, 1) / _attention_s(sizes, long, 1, device, dtype, repeats, sync)
    else:
        rate = _executed(sizes, rows, items) / attention
    return LayerFacts(host, min(1.0, forward / host), rate, elementwise)
