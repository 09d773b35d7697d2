"""The oracle can fail: faults injected into a layout (on one rank, or everywhere where the bug would be
everywhere) make `loom verify` FAIL, in fp32 and in bf16, and name the quantity that caught them. The same
layouts without the fault pass in tests/test_parity.py (dp2, fan-in, cp2 and their bf16 rows).

Also: what verify refuses to do (compare a model with its own copy, zero steps, a non-finite reference),
and its one-process comparisons (compiled vs eager, bf16 vs fp32).
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.distributed as dist
from conftest import TINY_MODEL_OVERRIDES
from oracle import run_verify

import loom.cli
from loom.train.compare import FP32, Agreement, ModuleCheck, StepCheck, relative, worst

CP2 = ["--layout.language.cp=2", "--data.pad_to_multiple=4"]
FAN_IN = ["--layout.vision.tp=1", "--layout.language.tp=2"]  # vision and audio dp4 → LLM dp2 on 4 ranks
FAULTY_RANK = 1


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


@contextlib.contextmanager
def _patched(obj, name: str, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def _bridge_output(change):
    """Patches every encoder's bridge so its output (rows for the LLM) goes through change(bridge, rows)."""
    from loom.bridge.colocated import ColocatedBridge

    call = ColocatedBridge.__call__
    return _patched(ColocatedBridge, "__call__", lambda self, *a: change(self, call(self, *a)))


def _layout_inputs(change):
    """Patches the layout's step inputs (verify builds the reference's separately)."""
    import loom.train.verify as verify

    make = verify.step_inputs
    return _patched(verify, "step_inputs", lambda *a: change(make(*a)))


def _fault(name: str):
    """The fault, applied in this rank's process (each rank is its own process)."""
    import loom.bridge.colocated as bridge

    me = dist.get_rank()
    if name == "encoder gradient scaled by llm_dp/encoder_dp":  # Megatron-Bridge #4066, on every rank
        return _bridge_output(lambda b, rows: _ScaleGrad.apply(rows, b.dst_dp / b.src_dp))
    if name == "one bridge row wrong":  # rank 1's first row of each modality arrives negated
        def negate_first(b, rows):
            return torch.cat([-rows[:1], rows[1:]]) if me == FAULTY_RANK else rows

        return _bridge_output(negate_first)
    if name == "nan in one rank's encoder output":
        def poison(b, rows):
            if me != FAULTY_RANK or b.src.module != "vision":
                return rows
            return torch.cat([rows[:1] * math.nan, rows[1:]])

        return _bridge_output(poison)
    if name == "cp sum dropped from the bridge backward":  # the encoders see one cp rank's gradient only
        return _patched(bridge, "sum_over_context", lambda grad, group: grad)
    if name == "one rank counts its tokens twice":  # the layout's inputs only: the reference has its own
        def doubled(inputs):
            if me == FAULTY_RANK:
                inputs.supervised += sum(m.llm.num_supervised for m in inputs.microbatches)
            return inputs

        return _layout_inputs(doubled)
    if name == "each replica divides by its own token count":
        def own(inputs):
            inputs.supervised = sum(m.llm.num_supervised for m in inputs.microbatches)
            return inputs

        return _layout_inputs(own)
    raise ValueError(name)


def _verify_with_fault(fault: str, overrides: list[str]) -> list[dict]:
    with _fault(fault):
        return run_verify(overrides, steps=1)  # every fault here shows in step 1; more steps cost CI, not coverage


# fault → (world size, layout, what must be named among the failures)
FAULTS = {
    "encoder gradient scaled by llm_dp/encoder_dp": (4, FAN_IN, "vision gradients"),
    "one bridge row wrong": (4, FAN_IN, "gradients"),
    "nan in one rank's encoder output": (2, [], "not finite"),
    "cp sum dropped from the bridge backward": (2, CP2, "vision gradients"),
    "one rank counts its tokens twice": (2, [], "language gradients"),  # its replica's share is scaled
    "each replica divides by its own token count": (2, [], "loss"),
}
# "one bridge row wrong" is fp32's to catch: one negated row of the tiny batch moves the LLM's gradients by
# 0.029 relative (measured, per-name initial weights), inside bf16's tolerance of 0.03
# bf16 repeats the faults whose size is nearest its tolerance (a factor on one module's or one replica's
# gradients); a NaN and the cp sum's factor 2 fail at any tolerance, so fp32 shows them once (CI minutes)
BF16_TOO = ["encoder gradient scaled by llm_dp/encoder_dp", "one rank counts its tokens twice"]
CASES = [(f, "fp32") for f in FAULTS] + [(f, "bf16") for f in BF16_TOO]


@pytest.mark.parametrize("fault,dtype", CASES, ids=[f"{f}-{d}".replace(" ", "_") for f, d in CASES])
def test_verify_fails_a_broken_layout(worlds, fault, dtype):
    world, layout, named = FAULTS[fault]
    per_rank = worlds.run(world, _verify_with_fault, fault, layout + [f"--train.dtype={dtype}"], timeout=300)
    for rank, steps in enumerate(per_rank):
        failures = [f for s in steps for f in s["failures"]]
        assert not steps[0]["passed"], f"rank {rank}: {fault} ({dtype}) passed step 1: {steps[0]['quantities']}"
        assert any(named in f for f in failures), f"rank {rank}: {fault} ({dtype}) not caught by {named!r}: {failures}"
        if fault == "encoder gradient scaled by llm_dp/encoder_dp" and dtype == "fp32":
            _caught_by_the_gradients_alone(steps[0])


def _caught_by_the_gradients_alone(step: dict) -> None:
    """Adam is nearly blind to a constant factor on a module's gradient: the updates differ by < 1e-2 while
    the gradients differ by 0.5 — the hole the old weight-only oracle had (it passed this fault in bf16)."""
    q = {what: value for what, value, _ in step["quantities"]}
    assert q["vision gradients"] == pytest.approx(0.5, rel=1e-3)  # half the gradient is missing
    # the updates barely move (Adam divides the factor out; only eps and clipping see it): ≥ 50× less
    assert q["vision update"] < 1e-2 and q["language gradients"] < FP32.grad


def _verify_counting_every_copy(overrides: list[str]) -> list[dict]:
    """verify with every rank taken as its modules' reporter: each replica's shards count in the sums."""
    import loom.train.verify as verify

    everyone = frozenset(range(dist.get_world_size()))
    with _patched(verify, "reporting_ranks", lambda share: dict.fromkeys(share.modules, everyone)):
        return run_verify(overrides, steps=1)


def test_a_replica_counted_twice_is_an_error(worlds):
    """Ranks compare their own shards with the reference's same elements and sum over the world, so each
    element must be counted once: under tp2 the norms sit whole on both tp ranks, and counting both copies
    would double their share of every sum. verify checks the count and stops."""
    from harness import WorldError

    with pytest.raises(WorldError, match="not counted exactly once.*input_layernorm.weight 256 of 128"):
        worlds.run(2, _verify_counting_every_copy, ["--layout.language.tp=2"], timeout=300)


# ---------------------------------------------------------------- the comparison's arithmetic


def _check(loss=1.0, norm=1.0, grads=None, update=None) -> StepCheck:
    g, u = Agreement(), Agreement()
    g.add(torch.tensor([1.0, 2.0]) if grads is None else grads, torch.tensor([1.0, 2.0]))
    u.add(torch.tensor([0.1, 0.1]) if update is None else update, torch.tensor([0.1, 0.1]))
    return StepCheck(1, loss, 1.0, norm, 1.0, {"vision": ModuleCheck(g, u)}, FP32)


def test_nan_and_inf_never_pass():
    assert _check().passed
    assert worst(0.0, math.nan) != worst(0.0, math.nan)  # NaN survives max(), unlike Python's max(0.0, nan)
    for bad in (dict(loss=math.nan), dict(norm=math.inf), dict(grads=torch.tensor([math.nan, 2.0])),
                dict(update=torch.tensor([0.1, math.inf]))):
        check = _check(**bad)
        assert not check.passed, bad
    assert any("not finite" in f for f in _check(norm=math.nan).failures)
    assert relative(0.0, 0.0) == 0.0 and relative(1e-9, 0.0) == math.inf  # frozen: any update is wrong


def test_a_wrong_gradient_element_fails_and_names_the_module():
    check = _check(grads=torch.tensor([1.0, 2.1]))
    assert [f for f in check.failures if "vision gradients" in f]


# ---------------------------------------------------------------- what verify refuses, one-process checks

TINY = [*TINY_MODEL_OVERRIDES, "--train.global_batch_size=4", "--data.train_size=64", "--train.device=cpu"]


def test_one_process_without_a_comparison_is_a_usage_error(capsys):
    assert loom.cli.main(["verify", "configs/tiny.toml", *TINY]) == 2
    err = capsys.readouterr().err
    assert "one process" in err and "torchrun --nproc-per-node=N" in err and "--against compile" in err


def test_zero_steps_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        loom.cli.main(["verify", "configs/tiny.toml", "--steps", "0"])
    assert e.value.code == 2 and "at least one step" in capsys.readouterr().err


@pytest.mark.parametrize("against", ["bf16", "compile"])
def test_one_process_against_compile_and_bf16_passes(capsys, against):
    assert loom.cli.main(["verify", "configs/tiny.toml", "--steps", "2", "--against", against, *TINY]) == 0
    out = capsys.readouterr().out
    assert out.count("PASS") == 2 and ("compiled" if against == "compile" else "eager bf16") in out


def test_a_non_finite_reference_stops_verify(capsys, monkeypatch):
    import loom.train.objective as objective

    loss = objective.loss_function
    monkeypatch.setattr(objective, "loss_function", lambda *a: lambda *b: loss(*a)(*b) * math.inf)
    assert loom.cli.main(["verify", "configs/tiny.toml", "--steps", "1", "--against", "bf16", *TINY]) == 1
    assert "reference's step 1 is not finite" in capsys.readouterr().err


def test_a_multi_rank_config_started_without_a_launcher_passes_the_verify_flags_on(monkeypatch):
    seen = []
    monkeypatch.setattr(loom.cli, "launch_local", lambda n, args: seen.append((n, args)) or 0)
    assert loom.cli.main(["verify", "--steps", "5", "--against", "compile", "--tolerance", "0.1"]) == 0
    n, args = seen[0]
    assert n == 4 and {"--steps=5", "--against=compile", "--tolerance=0.1"} <= set(args)
