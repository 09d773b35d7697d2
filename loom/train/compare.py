"""What `loom verify` compares, and how far apart a layout and the reference may be.

Per step: the mean loss and the global grad norm (before clipping); per module: its gradient norm, its
gradients before clipping and the optimizer, and its weight *update* (w_after − w_before), each rank's shards
against the same elements of the reference (reference_shards.py), summed over the world.
Gradients are compared directly because AdamW is blind to a constant factor on a module's gradient and one
global norm dilutes a small module: an encoder gradient wrong by encoder_dp/llm_dp moves no weight.
Every difference is relative, and NaN or inf in any compared quantity fails.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Tolerances:
    """Largest relative difference that passes, per quantity."""

    loss: float
    grad_norm: float  # the global norm and each module's
    grad: float  # max |g − g_ref| / max |g_ref| over a module
    update: float  # ‖Δw − Δw_ref‖ / ‖Δw_ref‖ over a module

    @staticmethod
    def uniform(value: float) -> Tolerances:
        return Tolerances(value, value, value, value)


# fp32 against fp32: only the order of reductions differs (dp/tp/cp sums, sharded matmuls). Losses, norms
# and gradients measured 1e-8..5e-6 apart, so 1e-5; a wrong factor, row or count moves them by ≥ 1e-3.
# Updates get 1e-3: Adam's first step is g / (|g| + eps), so a gradient element near eps (1e-8) turns
# rounding noise of 1e-12 into an update change of ~1e-4 of lr (measured: up to 4e-5 of the module's update
# norm); a wrong lr, a skipped step or stale optimizer state moves an update by ≥ 1e-1.
FP32 = Tolerances(loss=1e-5, grad_norm=1e-5, grad=1e-5, update=1e-3)
# bf16 compute (FSDP's mixed precision, or autocast on one process) against the fp32 reference: bf16 keeps
# 8 mantissa bits (rounding 4e-3). Measured on the tiny default model, 3 steps, dp / fan-in tp2 / fan-out /
# cp2: loss ≤ 1e-4, grad norms ≤ 3.4e-3, gradients ≤ 8.7e-3, updates ≤ 0.10 (step 1: Adam's g / |g| flips
# the sign of elements below bf16's noise). Each bound is 3-10× its measured worst; a gradient off by a
# factor of 2, a wrong token count or a skipped step exceeds it (tests/test_verify_catches.py).
BF16 = Tolerances(loss=1e-3, grad_norm=1e-2, grad=3e-2, update=0.3)
DEFAULT_TOLERANCES = {"fp32": FP32, "bf16": BF16}


def worst(a: float, b: float) -> float:
    """max() that keeps NaN (Python's max(x, nan) is x, which would hide a NaN difference)."""
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def relative(diff: float, scale: float) -> float:
    """diff / scale; two zeros agree exactly (a frozen module's update), anything over a zero scale is inf."""
    if scale == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / scale


@dataclass
class Agreement:
    """How far one module's tensors are from the reference's, accumulated tensor by tensor."""

    max_diff: float = 0.0  # max |x − x_ref|
    max_ref: float = 0.0  # max |x_ref|
    sq: float = 0.0  # Σ x²
    ref_sq: float = 0.0  # Σ x_ref²
    diff_sq: float = 0.0  # Σ (x − x_ref)²

    def add(self, x: torch.Tensor, ref: torch.Tensor, twin: bool = False, counted: bool = True) -> None:
        """`twin`: a second copy of a reference tensor already added (a tied weight's head copy under pp): its
        differences count, its norms not a second time. Not `counted`: a replica of elements another rank
        adds to the sums — only its maxima count."""
        if ref.numel() == 0:
            return
        x, ref = x.detach().to(ref.device, torch.float32), ref.detach().float()
        d = x - ref
        self.max_diff = worst(self.max_diff, float(d.abs().max()))
        self.max_ref = worst(self.max_ref, float(ref.abs().max()))
        if not counted:
            return
        if not twin:
            self.sq += float(x.square().sum())
            self.ref_sq += float(ref.square().sum())
        self.diff_sq += float(d.square().sum())

    @property
    def max_relative(self) -> float:
        return relative(self.max_diff, self.max_ref)

    @property
    def norm_relative(self) -> float:
        return relative(math.sqrt(self.diff_sq), math.sqrt(self.ref_sq))

    @property
    def norm(self) -> float:
        return math.sqrt(self.sq)

    @property
    def ref_norm(self) -> float:
        return math.sqrt(self.ref_sq)


@dataclass
class ModuleCheck:
    grads: Agreement | None  # None: the module is frozen on both sides (no gradients)
    update: Agreement

    @property
    def grad_norm_diff(self) -> float:
        return math.nan if self.grads is None else relative(abs(self.grads.norm - self.grads.ref_norm),
                                                            self.grads.ref_norm)


@dataclass
class StepCheck:
    step: int
    loss: float
    ref_loss: float
    grad_norm: float
    ref_grad_norm: float
    modules: dict[str, ModuleCheck]
    tolerances: Tolerances
    notes: list[str] = field(default_factory=list)  # structural problems found while comparing

    @property
    def loss_diff(self) -> float:
        return relative(abs(self.loss - self.ref_loss), abs(self.ref_loss))

    @property
    def grad_norm_diff(self) -> float:
        return relative(abs(self.grad_norm - self.ref_grad_norm), self.ref_grad_norm)

    def quantities(self) -> list[tuple[str, float, float]]:
        """(what, relative difference, tolerance) for everything this step compares."""
        tol = self.tolerances
        out = [("loss", self.loss_diff, tol.loss), ("global grad norm", self.grad_norm_diff, tol.grad_norm)]
        for name, m in self.modules.items():
            if m.grads is not None:
                out += [(f"{name} grad norm", m.grad_norm_diff, tol.grad_norm),
                        (f"{name} gradients", m.grads.max_relative, tol.grad)]
            out.append((f"{name} update", m.update.norm_relative, tol.update))
        return out

    @property
    def failures(self) -> list[str]:
        bad = [f"step {self.step}: {what} differs by {value:.3g} (tolerance {limit:g})"
               for what, value, limit in self.quantities() if not value <= limit]  # NaN fails too
        for what, value in (("loss", self.loss), ("grad norm", self.grad_norm)):
            if not math.isfinite(value):
                bad.append(f"step {self.step}: the layout's {what} is {value} (not finite)")
        return [f"step {self.step}: {n}" for n in self.notes] + bad

    @property
    def passed(self) -> bool:
        return not self.failures
