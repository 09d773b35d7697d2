"""`loom verify`: a run against the one-process fp32 reference, step by step (what is compared: compare.py).

Under N ranks the run is the configured layout: every rank builds the model from the same seed and keeps an
unsharded fp32 copy as the reference; the layout takes its dp share of global batch `s`, the reference all
of it, both through the same `train_step`; every step after the first starts the layout from the reference's
weights and AdamW state (resync.py), so it measures that step alone. On one process there is no layout, so
the run is the same model compiled (`--against compile`) or in bf16 (`--against bf16`) — never the model
against its own copy.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table
from torch.distributed.tensor import DTensor

from loom.config import JobConfig
from loom.parallel.compile import compile_backend
from loom.parallel.tied import tied_copy_names
from loom.train.build import build_job
from loom.train.compare import DEFAULT_TOLERANCES, Agreement, ModuleCheck, StepCheck, Tolerances
from loom.train.inputs import StepInputs, collate
from loom.train.objective import Objective, make_objective
from loom.train.optim import GradNormShare, ModuleOptimizers, reduce_values
from loom.train.rank_plan import one_process_plan
from loom.train.reference import reference_policy
from loom.train.reference_shards import held, held_difference, reporting_ranks, shard_pair
from loom.train.resync import resync_from_reference
from loom.train.runners import RunContext
from loom.train.step_data import global_batch, step_inputs

AGAINST = ("layout", "compile", "bf16")


class VerifyUsageError(ValueError):
    """verify was asked for something that compares nothing (exit 2)."""


class ReferenceNotFinite(RuntimeError):
    """The reference step itself is not finite: there is nothing to verify against."""


def checked_config(cfg: JobConfig, against: str, distributed: bool) -> JobConfig:
    """The configuration of the run under test."""
    if against not in AGAINST:
        raise VerifyUsageError(f"--against {against!r}: choose one of {list(AGAINST)}")
    if against == "layout" and not distributed:
        raise VerifyUsageError(
            "loom verify compares a layout on N ranks with the one-process reference, and this is one process: "
            "comparing the model with its own copy would prove nothing. Run it on N ranks "
            "(`torchrun --nproc-per-node=N -m loom verify CONFIG`, or set layout.world_size = N in the config), "
            "or check one process against the eager fp32 reference with --against compile or --against bf16")
    if against != "layout" and distributed:
        raise VerifyUsageError(
            f"--against {against} is a one-process check; under {dist.get_world_size()} ranks verify compares "
            f"the layout (set train.compile / train.dtype in the config to check them under the layout too)")
    train = cfg.train
    if against == "compile":
        train = dataclasses.replace(train, compile=True)
    elif against == "bf16":
        train = dataclasses.replace(train, dtype="bf16")
    return dataclasses.replace(cfg, train=train)


def verify(cfg: JobConfig, steps: int, tolerance: float | None = None, device: torch.device | None = None,
           console: Console | None = None, against: str = "layout",
           objective: Callable[[str | None, RunContext], Objective] | None = None) -> list[StepCheck]:
    """`objective(compile_backend, run_context)`: the objective both sides train (default: the one
    `train.objective` names); the backend is None when not compiled."""
    if steps < 1:
        raise VerifyUsageError(f"--steps {steps}: verify needs at least one step")
    distributed = dist.is_initialized()
    checked = checked_config(cfg, against, distributed)
    tolerances = DEFAULT_TOLERANCES[checked.train.dtype] if tolerance is None else Tolerances.uniform(tolerance)
    job = build_job(checked, device, reference=True)
    cfg, model, reference, plan, batches = job.cfg, job.model, job.reference, job.plan, job.batches
    modules = [*reference.encoder_names, "language"]
    optimizer, ref_optimizer = job.optimizer, ModuleOptimizers(reference, modules, cfg.train)
    # the reference: eager fp32 on one process, the whole global batch at once, the same objective
    eager_fp32 = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, compile=False, dtype="fp32"))
    ref_plan = one_process_plan(modules, plan.sample_multiple, "fp32", job.device, cfg.model.language)
    ref_plan.reference = reference_policy(reference, cfg)  # train.reference: the same frozen weights, whole

    def configured(backend: str | None, how: RunContext) -> Objective:  # both sides: the one the config names
        return make_objective(cfg.train, backend, how.vocab_sharded, how.cp_group)

    make = objective or configured
    out = console or Console(width=170)
    share = plan.comms.norm_share  # each rank compares the weights it holds; one rank per module stage reports
    twins, reporters = tied_copy_names(model), reporting_ranks(share)
    checks, first_notes = [], compare_initial(held(model), parameters(reference), share, twins)
    for step in range(steps):
        if step > 0:  # each later step measures the layout alone, not the drift of the steps before it
            resync_from_reference(model, optimizer, reference, ref_optimizer)
        mine = step_inputs(batches, step, plan, cfg, job.tok, job.counters, job.device, job.data.bad)
        whole_batch = global_batch(batches, step, cfg, job.counters, plan.sample_multiple)
        full = StepInputs.of(collate(whole_batch, eager_fp32, job.tok).to(job.device))
        ref_before, ref_grads = parameters(reference), {}
        ref = ref_plan.train_step(reference, ref_optimizer, full, eager_fp32, step,
                                  inspect_grads=lambda m: ref_grads.update(gradients(m)),
                                  objective=make(None, ref_plan.run_context))
        if not (math.isfinite(ref.loss) and math.isfinite(ref.grad_norm)):
            raise ReferenceNotFinite(
                f"the reference's step {step + 1} is not finite (loss {ref.loss}, grad norm {ref.grad_norm}): "
                f"there is nothing to verify against; lower train.lr or check the data")
        before, grads, notes = held(model), {}, first_notes if step == 0 else []
        compare = functools.partial(compare_gradients, ref_grads=ref_grads, notes=notes, share=share,
                                    reporters=reporters)
        r = plan.train_step(model, optimizer, mine, cfg, step, inspect_grads=lambda m: grads.update(compare(m)),
                            objective=make(compile_backend(cfg.train), plan.run_context))
        updates = compare_updates(before, held(model), ref_before, parameters(reference), share, reporters, twins)
        notes += compare_router_biases(model, reference)
        checks.append(StepCheck(step + 1, r.loss, ref.loss, r.grad_norm, ref.grad_norm,
                                {m: ModuleCheck(grads.get(m), updates[m]) for m in updates}, tolerances, notes))
    if plan.is_logger:
        out.print(report(checks, checked, plan, against))
        for failure in (f for c in checks for f in c.failures):
            out.print(f"[red]FAIL[/red] {failure}")
    return checks


def compare_router_biases(model: torch.nn.Module, reference: torch.nn.Module) -> list[str]:
    """The routers' choice biases after the step's update (buffers, moved by counts, not gradients): the
    counts are whole numbers summed over the layout's ranks, so the biases must equal the reference's."""
    ref = dict(reference.named_buffers())
    return [f"{name}: router bias after the step differs from the reference's by {(b - ref[name]).abs().max():.3g}"
            for name, b in model.named_buffers()
            if name.endswith("e_score_correction_bias") and not torch.allclose(b, ref[name], rtol=0, atol=1e-7)]


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a sharded (DTensor) one — a collective over its mesh — or the tensor itself."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, whole, copied (every rank hosting the module calls this: it gathers shards)."""
    return {name: _full(p.detach()).clone() for name, p in model.named_parameters()}


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def compare_initial(layout: dict[str, torch.Tensor], reference: dict[str, torch.Tensor],
                    share: GradNormShare | None, twins: dict[str, str]) -> list[str]:
    """Failures where the layout's initial weights are not bitwise the reference's: initialisation must not
    depend on the layout. Every rank checks the shards it holds; every rank gets all notes, one per weight."""
    worst_delta: dict[str, float] = {}
    for name, value in layout.items():
        pair = shard_pair(value, reference[twins.get(name, name)], None)
        if not torch.equal(pair.mine, pair.reference):
            worst_delta[name] = float((pair.mine - pair.reference).abs().max())
    if share is not None:
        everyone: list[dict[str, float]] = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(everyone, worst_delta)
        worst_delta = {}
        for rank_deltas in everyone:
            for name, delta in rank_deltas.items():
                worst_delta[name] = max(delta, worst_delta.get(name, 0.0))
    return [f"{name.split('.', 1)[0]}: {name} starts from other values than the reference's (max |Δ| {d:.3g})"
            for name, d in worst_delta.items()]


def compare_gradients(model: torch.nn.Module, ref_grads: dict[str, torch.Tensor], notes: list[str],
                      share: GradNormShare | None = None,
                      reporters: dict[str, frozenset[int]] | None = None) -> dict[str, Agreement]:
    """Per module: the layout's gradients (each rank its shards, summed over the world) against the
    reference's, before clipping. A gradient present on one side only is noted as a failure."""
    out: dict[str, Agreement] = {}
    twins = tied_copy_names(model)
    for name, p in model.named_parameters():
        module, ref_name = name.split(".", 1)[0], twins.get(name, name)
        if (p.grad is None) != (ref_name not in ref_grads):
            side = "the reference" if p.grad is None else "the layout"
            notes.append(f"{module}: {name} has a gradient on {side} only")
            continue
        if p.grad is not None:
            pair = shard_pair(p.grad, ref_grads[ref_name], reporters and reporters[module])
            out.setdefault(module, Agreement()).add(pair.mine, pair.reference, name in twins, pair.counted)
    return _over_world(out, share)


def compare_updates(before: dict, after: dict, ref_before: dict, ref_after: dict,
                    share: GradNormShare | None = None, reporters: dict[str, frozenset[int]] | None = None,
                    twins: dict[str, str] | None = None) -> dict[str, Agreement]:
    """Per module: the step's weight change against the reference's (frozen: both must be zero), each rank
    comparing the shards it holds. Every element of every reference weight must be counted exactly once over
    the world: a weight no rank holds, or a replica counted twice, is an error."""
    out: dict[str, Agreement] = {}
    twins = twins or {}
    counted = dict.fromkeys(ref_after, 0.0)
    for name, value in after.items():
        module, ref_name = name.split(".", 1)[0], twins.get(name, name)
        pair = shard_pair(held_difference(value, before[name]), ref_after[ref_name] - ref_before[ref_name],
                          reporters and reporters[module])
        out.setdefault(module, Agreement()).add(pair.mine, pair.reference, name in twins, pair.counted)
        if pair.counted and name not in twins:
            counted[ref_name] += pair.mine.numel()
    if share is not None:
        counted = dict(zip(counted, reduce_values(list(counted.values()), dist.ReduceOp.SUM, None)))
    wrong = [f"{name} {n:.0f} of {ref_after[name].numel()} elements" for name, n in counted.items()
             if n != ref_after[name].numel()]
    if wrong:
        raise RuntimeError(f"verify: weights whose elements are not counted exactly once over the ranks: {wrong[:5]}")
    return _over_world(out, share)


def _over_world(agreements: dict[str, Agreement], share: GradNormShare | None) -> dict[str, Agreement]:
    """Every module's agreement on every rank: each rank adds the measures of the shards it holds (sums only
    for the copies it counts), one reduction for all modules."""
    if share is None:
        return agreements
    zero = Agreement()
    mine = [agreements.get(m, zero) for m in share.modules]
    # NaN → inf before MAX: a reduction may drop NaN, inf still fails
    peaks = reduce_values([x if x == x else math.inf for a in mine for x in (a.max_diff, a.max_ref)],
                          dist.ReduceOp.MAX, None)
    sums = reduce_values([x for a in mine for x in (a.sq, a.ref_sq, a.diff_sq)], dist.ReduceOp.SUM, None)
    present = reduce_values([float(m in agreements) for m in share.modules], dist.ReduceOp.MAX, None)
    return {m: Agreement(*peaks[2 * i : 2 * i + 2], *sums[3 * i : 3 * i + 3])
            for i, m in enumerate(share.modules) if present[i]}


def report(checks: list[StepCheck], cfg: JobConfig, plan, against: str) -> Table:
    if plan.topo is not None:
        layouts = ", ".join(f"{n} {g.layout.describe().split(' on ')[0]}" for n, g in plan.topo.grids.items())
        run = f"{dist.get_world_size()} ranks: {layouts} ({cfg.train.dtype})"
    else:
        run = f"one process, {'compiled' if against == 'compile' else 'eager'} {cfg.train.dtype}"
    tol = checks[0].tolerances
    table = Table(title=f"loom verify — {run} vs one-process eager fp32 reference\n"
                        f"relative tolerances: loss {tol.loss:g}, grad norms {tol.grad_norm:g}, "
                        f"gradients (max) {tol.grad:g}, updates (norm) {tol.update:g}")
    for col in ("step", "module", "loss", "ref loss", "Δ loss", "grad norm", "ref norm", "Δ norm", "Δ grad",
                "Δ update", "result"):
        table.add_column(col, justify="left" if col == "module" else "right")
    for c in checks:
        verdict = "[green]PASS" if c.passed else "[red]FAIL"
        table.add_row(str(c.step), "all", f"{c.loss:.6f}", f"{c.ref_loss:.6f}", _e(c.loss_diff), f"{c.grad_norm:.5f}",
                      f"{c.ref_grad_norm:.5f}", _e(c.grad_norm_diff), "", "", verdict)
        for name, m in c.modules.items():
            g = m.grads
            table.add_row("", name, "", "", "", "–" if g is None else f"{g.norm:.5f}",
                          "–" if g is None else f"{g.ref_norm:.5f}", "–" if g is None else _e(m.grad_norm_diff),
                          "–" if g is None else _e(g.max_relative), _e(m.update.norm_relative), "")
    return table


def _e(x: float) -> str:
    return f"{x:.1e}"
