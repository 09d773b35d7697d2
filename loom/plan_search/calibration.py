"""The machine facts the cost model reads: matmul rate, memory bandwidth, host overhead, each collective's latency
and bus bandwidth per group size, and loom's own layers (host time, attention and elementwise rates) — one small
JSON (`loom plan --search --calibration FILE`).

`loom plan --calibrate` measures them on the machine it runs on (plan_search/calibrate.py); without a file the
search uses H200_DEFAULTS, taken from measurements already recorded in this repository.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from loom.typed_config import ConfigError

COLLECTIVES = ("all_gather", "all_reduce")  # measured kinds; the others are costed as one of them (cost.py)


@dataclass(frozen=True)
class Link:
    """One collective on a group of a given size: time = latency_s + bus bytes / bus_bytes_per_s."""

    latency_s: float
    bus_bytes_per_s: float


@dataclass(frozen=True)
class LayerFacts:
    """One kind of loom layer on this machine (0: not measured, each fact falling back on its own)."""

    host_s: float = 0.0  # forward + backward on a handful of tokens: the host's time (else overhead_per_layer_s)
    forward_share: float = 0.0  # of host_s, the forward's (else a third, the matmuls' share)
    # its attention, forward + backward as executed (3.5× the forward: the backward recomputes the scores): the
    # decoder's on one long causal sample, the encoder's on image-sized items (else the matmul rate)
    attention_flops_per_s: float = 0.0
    # the activation bytes the cost model counts for the layer over its time beyond matmuls and attention: the
    # rate its elementwise kernels reach (eager ones move more than the count; else memory_bytes_per_s)
    elementwise_bytes_per_s: float = 0.0


NOT_MEASURED = LayerFacts()


@dataclass(frozen=True)
class Calibration:
    device: str  # what it was measured on, in words
    matmul_flops_per_s: float  # per device, the rate the training matmuls run at
    memory_bytes_per_s: float  # per device, a large copy's rate: elementwise kernels and AdamW are bound by it
    overhead_per_layer_s: float  # host time of a generic block's forward + backward (a layer's where `layers` has none)
    overhead_per_microbatch_s: float  # host time per microbatch outside the blocks (loss, data, hooks)
    # GPU: the host queues kernels while earlier ones run, so a rank takes max(host, device); CPU: the sum
    host_overlaps_device: bool
    memory_reserved_bytes: float  # per device, never available to tensors (CUDA context, allocator slack)
    # kind → group size → Link; a size not measured takes the nearest measured size below it (or the smallest)
    collectives: dict[str, dict[int, Link]] = field(default_factory=dict)
    source: str = ""  # where the numbers come from
    # "tp" / "fsdp" → group size → host and synchronisation time one layer's forward + backward adds per
    # microbatch when split over that many ranks, beyond its collectives' own latency and bytes (DTensor
    # dispatch, FSDP hooks, waiting for the slowest rank); measured on a tiny block, none in the defaults
    layer_extra_s: dict[str, dict[int, float]] = field(default_factory=dict)
    # "decoder" (the LLM's layer) / "encoder" (the towers') → loom's own layer timed (layer_probe.py); a kind or a
    # fact not measured (a file written before these were) falls back as LayerFacts says
    layers: dict[str, LayerFacts] = field(default_factory=dict)

    def layer(self, kind: str) -> LayerFacts:
        return self.layers.get(kind, NOT_MEASURED)

    def attention_rate(self, kind: str) -> float:
        """FLOP/s of `kind`'s attention, forward + backward as executed; not measured: the matmul rate."""
        return self.layer(kind).attention_flops_per_s or self.matmul_flops_per_s

    def elementwise_rate(self, kind: str) -> float:
        """Bytes/s at which `kind`'s elementwise kernels move the activations the cost model counts; not measured:
        a copy's rate."""
        return self.layer(kind).elementwise_bytes_per_s or self.memory_bytes_per_s

    def layer_host_s(self, kind: str) -> float:
        """Host time of one `kind` layer's forward + backward; not measured: overhead_per_layer_s (a generic block)."""
        return self.layer(kind).host_s or self.overhead_per_layer_s

    def extra(self, kind: str, group: int) -> float:
        """layer_extra_s for `group` ranks: the nearest measured size below it; 0 for one rank or none measured."""
        table = self.layer_extra_s.get(kind)
        if group <= 1 or not table:
            return 0.0
        below = [g for g in table if g <= group]
        return table[max(below) if below else min(table)]

    def link(self, kind: str, group: int) -> Link:
        table = self.collectives.get(kind)
        if not table:
            raise ConfigError(f"calibration {self.device!r} has no {kind!r} measurements (kinds: "
                              f"{sorted(self.collectives)})")
        below = [g for g in table if g <= group]
        return table[max(below) if below else min(table)]

    def to_json(self) -> dict:
        out = asdict(self)
        out["collectives"] = {kind: {str(g): asdict(link) for g, link in sorted(table.items())}
                              for kind, table in self.collectives.items()}
        out["layer_extra_s"] = {kind: {str(g): s for g, s in sorted(table.items())}
                                for kind, table in self.layer_extra_s.items()}
        out["layers"] = {kind: asdict(facts) for kind, facts in self.layers.items()}
        return out

    @staticmethod
    def from_json(data: dict, where: str = "calibration") -> Calibration:
        try:
            collectives = {kind: {int(g): Link(float(v["latency_s"]), float(v["bus_bytes_per_s"]))
                                  for g, v in table.items()} for kind, table in data["collectives"].items()}
            extras = {kind: {int(g): float(s) for g, s in table.items()}
                      for kind, table in data.get("layer_extra_s", {}).items()}
            fields = {k: data[k] for k in ("device", "matmul_flops_per_s", "memory_bytes_per_s", "overhead_per_layer_s",
                                           "overhead_per_microbatch_s", "host_overlaps_device",
                                           "memory_reserved_bytes")}
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ConfigError(f"{where}: not a loom calibration ({type(e).__name__}: {e}); write one with "
                              f"`loom plan --calibrate --gpus N --calibration FILE`") from None
        for key in ("matmul_flops_per_s", "memory_bytes_per_s"):
            if not float(fields[key]) > 0:
                raise ConfigError(f"{where}: {key} = {fields[key]} must be > 0")
        for kind in COLLECTIVES:
            if kind not in collectives:
                raise ConfigError(f"{where}: collectives.{kind} is missing (measured kinds: {list(COLLECTIVES)})")
        try:
            layers = {kind: LayerFacts(**{k: float(v) for k, v in facts.items()})
                      for kind, facts in data.get("layers", {}).items()}
        except (TypeError, ValueError, AttributeError) as e:
            raise ConfigError(f"{where}: layers: {type(e).__name__}: {e} (each kind takes "
                              f"{list(LayerFacts.__annotations__)})") from None
        for kind, facts in layers.items():
            if min(asdict(facts).values()) < 0:
                raise ConfigError(f"{where}: layers.{kind} = {asdict(facts)}: every fact must be >= 0 "
                                  f"(0: not measured)")
        return Calibration(collectives=collectives, source=str(data.get("source", "")), layer_extra_s=extras,
                           layers=layers, **fields)


def load_calibration(path: str | Path | None) -> Calibration:
    """The file's calibration, or H200_DEFAULTS when no file is given."""
    if path is None:
        return H200_DEFAULTS
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--calibration {str(path)!r} does not exist; write it with `loom plan --calibrate "
                          f"--gpus N --calibration {path}`")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"--calibration {str(path)!r}: not JSON ({e})") from None
    return Calibration.from_json(data, str(path))


def save_calibration(cal: Calibration, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cal.to_json(), indent=1) + "\n")
    return path


def _h200_links(bus_bytes_per_s: float, latency_s: float) -> dict[int, Link]:
    return {g: Link(latency_s, bus_bytes_per_s) for g in (2, 4, 8)}


# H200 (one host, NVLink), bf16. Sources:
# - matmul 800 TFLOP/s: ../shared/DESIGN.md ("bf16 matmul ≈ 800 TFLOP/s per H200") and bench/RESULTS.md (8192³
#   measured at 798–806 TFLOP/s in every H200 run; training matmuls ran at ~95% of it in the 2B profile).
# - NCCL bus bandwidth 320 GB/s: ../shared/DESIGN.md ("NCCL all-reduce ≈ 320 GB/s bus bw (4 GPUs)"), used for
#   every kind and group size (not measured per size yet); latency 30 µs is an assumption, not a measurement.
# - memory 3.0 TB/s: bench/RESULTS.md, fused AdamW over 1.72B fp32 parameters × 28 bytes in 16 ms ("3.0 TB/s
#   against 4.3 TB/s measured copies") — the rate the memory-bound kernels reach.
# - host 1.7 ms per block forward + backward: bench/RESULTS.md's speed4 profile (compiled blocks, "each cost
#   1.5–1.9 ms of host time under the profiler"); the GPU runs ahead of the host, so max(host, device).
# - 4 GiB reserved per GPU: an estimate (CUDA context, NCCL buffers, allocator fragmentation), not measured.
# - the LLM's attention 254 TFLOP/s: bench/results/2026-11-24-speed4-fa4-attn.jsonl, FlashAttention 2 varlen
#   (torch 2.11's varlen_attn, loom's `auto` on CUDA) forward + backward of one causal 8,192-token sample, 16 heads
#   of 128 (8 K/V heads) in 3.787 ms: 2·8192²·2048 forward FLOPs × 3.5 as executed.
# - the encoders' attention 105 TFLOP/s: bench/RESULTS.md (2026-11-25 profile), FA2 varlen runs the ViT's 72-wide
#   heads at ~90 TFLOP/s by flops.py's count (3× the forward), 105 as executed (3.5×).
H200_DEFAULTS = Calibration(
    device="NVIDIA H200 (defaults from bench/RESULTS.md and ../shared/DESIGN.md)",
    matmul_flops_per_s=800e12,
    memory_bytes_per_s=3.0e12,
    overhead_per_layer_s=1.7e-3,
    overhead_per_microbatch_s=5e-3,
    host_overlaps_device=True,
    memory_reserved_bytes=4 * 2**30,
    collectives={kind: _h200_links(320e9, 30e-6) for kind in COLLECTIVES},
    source="defaults: ../shared/DESIGN.md (800 TFLOP/s, 320 GB/s), bench/RESULTS.md (3.0 TB/s, 1.7 ms/block, "
           "attention 254 / 105 TFLOP/s)",
    layers={"decoder": LayerFacts(attention_flops_per_s=254e12), "encoder": LayerFacts(attention_flops_per_s=105e12)},
)
