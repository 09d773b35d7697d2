"""Training: it learns, it is deterministic, it resumes exactly, the schedule and clipping are right, the CLI works."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch

import loom.cli
from conftest import saved_tensors, tiny_job_overrides
from readme_figures import short_form_band
from loom.config import TrainConfig
from loom.job import load_config
from loom.data.batch import IGNORE_INDEX
from loom.data.packing import pack_samples
from loom.checkpoint.sharded import load_sharded
from loom.train.optim import clip_and_check, lr_factor, set_lr
from loom.train.trainer import Trainer


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The tiny model gains nothing from intra-op threads, and on a busy 2-core machine they oversubscribe
    the cores (the overfit test goes from ~3 s to ~20 s); the setting is restored after this module."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _trainer(out_dir, *extra: str) -> Trainer:
    return Trainer(load_config(None, tiny_job_overrides(out_dir, *extra)))


def _records(out_dir: Path, kind: str = "train") -> list[dict]:
    lines = (Path(out_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _naive_mean_loss(model, samples, pad_id) -> float:
    """Mean next-token cross-entropy over supervised tokens, each sample run alone, log-softmax by hand."""
    total, count = 0.0, 0
    with torch.no_grad():
        for s in samples:
            b = pack_samples([s], pad_id)
            logits = model(b.input_ids, b.positions, b.spans, b.modality_inputs).double()
            logp = logits - logits.logsumexp(-1, keepdim=True)
            for i in range(len(s) - 1):
                if s.supervised[i + 1]:
                    total -= logp[i, s.tokens[i + 1]].item()
                    count += 1
    return total / count


# ---------------------------------------------------------------- it learns


def test_overfits_a_fixed_batch(tmp_path):
    steps = 80
    t = _trainer(tmp_path, "--train.global_batch_size=8", f"--train.steps={steps}", "--train.lr=1e-2",
                 "--train.warmup_steps=5", "--train.weight_decay=0")
    samples = t.batches.shard(0)
    assert len(samples) == 8 and {s.task for s in samples} == {"digits", "shapes", "tones"}
    vocab = t.cfg.model.language.vocab_size

    initial = _naive_mean_loss(t.model, samples, t.tok.pad_id)
    assert abs(initial - math.log(vocab)) < 0.1  # small init: close to a uniform guess over the vocabulary

    results = [t.train_step(samples) for _ in range(steps)]
    assert abs(results[0].loss - initial) < 1e-5  # the reported loss is the loss before the first update
    assert not any(r.skipped for r in results)
    final = _naive_mean_loss(t.model, samples, t.tok.pad_id)
    assert final < 0.05 * initial, f"loss {initial:.3f} → {final:.3f}"

    # the answers are memorised, which needs the image / audio content (the prompts repeat across samples)
    b = pack_samples(samples, t.tok.pad_id)
    with torch.no_grad():
        pred = t.model(b.input_ids, b.positions, b.spans, b.modality_inputs).argmax(-1)
    sup = b.labels != IGNORE_INDEX
    assert (pred[sup] == b.labels[sup]).float().mean() > 0.95


@pytest.mark.parametrize("thd_multiple", [1, 4])
def test_trainer_step_same_in_bshd_and_thd(tmp_path, thd_multiple):
    """One optimizer step through the trainer's own collation: same loss, same grad norm, same new weights."""
    thd = _trainer(tmp_path / "thd", "--data.format=thd", f"--data.pad_to_multiple={thd_multiple}")
    bshd = _trainer(tmp_path / "bshd", "--data.format=bshd")
    samples = thd.batches.shard(0)
    a, b = thd.train_step(samples), bshd.train_step(samples)
    assert a.loss == pytest.approx(b.loss, rel=1e-5) and a.grad_norm == pytest.approx(b.grad_norm, rel=1e-4)
    # Adam moves each weight by about lr (1e-3 here) with the sign of its gradient; allow 1% of that for
    # elements whose gradient is at the level of float rounding
    wa, wb = thd.model.state_dict(), bshd.model.state_dict()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=1e-5, msg=k)


def test_compile_traces_every_block_and_keeps_parameter_names(tmp_path):
    """`train.compile` really compiles (dynamo captures graphs for the blocks and the loss), the model keeps
    its parameter names (checkpoints and HF export unchanged), and a step gives the eager step's result.
    Dynamo captures the same graphs whatever the backend; aot_eager spares CI inductor's C++ compile."""
    from torch._dynamo.utils import counters

    eager = _trainer(tmp_path / "eager")
    compiled = _trainer(tmp_path / "compiled", "--train.compile=true", "--train.compile_backend=aot_eager")
    assert list(compiled.model.state_dict()) == list(eager.model.state_dict())
    for layer in compiled.model.language.layers.values():
        assert hasattr(layer.forward, "_torchdynamo_orig_callable")
    before = counters["stats"]["unique_graphs"]
    samples = eager.batches.shard(0)
    a, b = eager.train_step(samples), compiled.train_step(samples)
    assert counters["stats"]["unique_graphs"] > before
    assert b.loss == pytest.approx(a.loss, rel=1e-5) and b.grad_norm == pytest.approx(a.grad_norm, rel=1e-5)


def test_compile_backend_reaches_the_blocks_and_the_loss(tmp_path):
    """`train.compile_backend = "aot_eager"` (what the CPU tests compile with) traces the blocks and the loss
    through AOTAutograd and never reaches inductor; inductor is the default, and no other backend is taken."""
    from torch._dynamo.utils import counters

    from loom.config import ConfigError
    from loom.train.loss import compiled_token_loss_sum, loss_function

    assert load_config(None, []).train.compile_backend == "inductor"
    with pytest.raises(ConfigError, match="train.compile_backend"):
        load_config(None, ["--train.compile_backend=eager"])
    torch._dynamo.reset()  # frames compiled by earlier tests neither count nor serve this run
    trainer = _trainer(tmp_path, "--train.compile=true", "--train.compile_backend=aot_eager")
    inductor, traced = sum(counters["inductor"].values()), counters["aot_autograd"]["total"]
    trainer.train_step(trainer.batches.shard(0))
    assert counters["aot_autograd"]["total"] > traced and sum(counters["inductor"].values()) == inductor
    assert loss_function("aot_eager", False) is compiled_token_loss_sum("aot_eager")
    assert trainer.plan.objective(trainer.cfg).token_loss is compiled_token_loss_sum("aot_eager")


# ---------------------------------------------------------------- determinism and resume


def test_two_runs_are_bit_identical(tmp_path):
    results = []
    for name in ("a", "b"):
        out = tmp_path / name
        final = _trainer(out).run()
        results.append((out, final))
    (a, fa), (b, fb) = results
    ra, rb = _records(a), _records(b)
    assert [r["step"] for r in ra] == [1, 2, 3, 4, 5]
    assert [r["loss"] for r in ra] == [r["loss"] for r in rb]
    assert [r["grad_norm"] for r in ra] == [r["grad_norm"] for r in rb]
    assert fa == fb
    (wa, ma), (wb, mb) = saved_tensors(a / "step-5"), saved_tensors(b / "step-5")
    assert wa.keys() == wb.keys() and ma == mb
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # and training did change the weights (the comparison is not between two untouched inits)
    init = _trainer(tmp_path / "init").model.state_dict()
    assert any(not torch.equal(init[k], wa[k]) for k in wa)


def test_different_seed_gives_different_run(tmp_path):
    a, b = _trainer(tmp_path / "a"), _trainer(tmp_path / "b", "--train.seed=1")
    assert not torch.equal(a.model.language.embed_tokens.weight, b.model.language.embed_tokens.weight)


def test_resume_continues_exactly(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    # 6 steps straight through, leaving a checkpoint after step 3 on the way
    _trainer(straight, "--train.steps=6", "--run.save_every=3").run()
    ckpt = straight / "step-3"
    assert json.loads((ckpt / "state.json").read_text())["step"] == 3

    t = _trainer(resumed, "--train.steps=6", f"--run.resume={ckpt}")
    assert t.step == 3
    t.run()
    a, b = _records(straight), _records(resumed)
    assert [r["step"] for r in b] == [4, 5, 6]
    for ra, rb in zip(a[3:], b, strict=True):
        assert ra["step"] == rb["step"]
        assert rb["loss"] == ra["loss"] and rb["grad_norm"] == ra["grad_norm"]  # bit-identical on CPU
        assert rb["lr"] == ra["lr"]
    wa, wb = saved_tensors(straight / "step-6")[0], saved_tensors(resumed / "step-6")[0]
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-6, atol=1e-7, msg=k)


def test_resume_needs_the_optimizer_state(tmp_path):
    """Control for the test above: weights alone (fresh AdamW moments) do not reproduce steps 5-6,
    so matching losses there really do show the optimizer state was restored."""
    straight = tmp_path / "straight"
    _trainer(straight, "--train.steps=6", "--run.save_every=3").run()
    t = _trainer(tmp_path / "w", "--train.steps=6")
    t.step = load_sharded(straight / "step-3", t.model, None, t.weight_aliases)["step"]
    losses = [t.train_step(t.batches.shard(t.step)).loss for _ in range(3)]
    want = [r["loss"] for r in _records(straight)[3:]]
    assert losses[0] == pytest.approx(want[0], rel=1e-6)  # same weights: same first loss
    assert abs(losses[2] - want[2]) > 1e-4 * abs(want[2])


def test_checkpoint_round_trip_keeps_tied_weights(tmp_path):
    t = _trainer(tmp_path, "--train.steps=2")
    for _ in range(2):
        t.train_step(t.batches.shard(t.step))
    t.checkpoint()
    u = _trainer(tmp_path / "u", "--train.steps=2", f"--run.resume={tmp_path / 'step-2'}")
    lang = u.model.language
    assert lang.lm_head.weight is lang.embed_tokens.weight
    for k, v in t.model.state_dict().items():
        assert torch.equal(u.model.state_dict()[k], v), k


# ---------------------------------------------------------------- learning-rate schedule


def test_lr_schedule_hand_computed_points():
    cfg = TrainConfig(steps=100, warmup_steps=10, lr=2.0, min_lr_ratio=0.1)
    # warmup: (step + 1) / warmup, linear
    assert [lr_factor(s, cfg) for s in range(10)] == pytest.approx([0.1 * (s + 1) for s in range(10)], abs=1e-12)
    # cosine over the remaining 90 steps, from 1 to 0.1
    assert lr_factor(10, cfg) == pytest.approx(1.0, abs=1e-12)
    assert lr_factor(40, cfg) == pytest.approx(0.1 + 0.9 * 0.75, abs=1e-12)  # 1/3 of the way: cos = 1/2
    assert lr_factor(55, cfg) == pytest.approx(0.55, abs=1e-12)  # halfway: cos = 0
    assert lr_factor(70, cfg) == pytest.approx(0.1 + 0.9 * 0.25, abs=1e-12)  # 2/3: cos = -1/2
    assert lr_factor(100, cfg) == pytest.approx(0.1, abs=1e-12)
    assert lr_factor(150, cfg) == pytest.approx(0.1, abs=1e-12)  # stays at the floor


def test_lr_schedule_formula_every_step():
    cfg = TrainConfig(steps=57, warmup_steps=7, lr=1e-3, min_lr_ratio=0.25)
    for s in range(cfg.steps + 3):
        if s < 7:
            want = (s + 1) / 7
        else:
            p = min(1.0, (s - 7) / 50)
            want = 0.25 + 0.75 * (1 + math.cos(math.pi * p)) / 2
        assert lr_factor(s, cfg) == pytest.approx(want, abs=1e-12), s
    after = [lr_factor(s, cfg) for s in range(7, cfg.steps + 1)]
    assert all(x >= y for x, y in zip(after, after[1:]))  # never increases after warmup


def test_lr_schedule_without_warmup_starts_at_peak():
    cfg = TrainConfig(steps=20, warmup_steps=0, min_lr_ratio=0.0)
    assert lr_factor(0, cfg) == pytest.approx(1.0)
    assert lr_factor(10, cfg) == pytest.approx(0.5)
    assert lr_factor(20, cfg) == pytest.approx(0.0, abs=1e-12)


def test_set_lr_sets_every_group(tmp_path):
    t = _trainer(tmp_path, "--train.steps=40", "--train.warmup_steps=4", "--train.lr=3e-3")
    lr = set_lr(t.optimizer, 1, t.cfg.train)
    assert lr == pytest.approx(3e-3 * 2 / 4)
    assert len(t.optimizer.param_groups) == 2 * 3  # decay / no-decay, for each of the three modules
    assert all(g["lr"] == pytest.approx(3e-3 * 2 / 4) for g in t.optimizer.param_groups)
    # the trainer reports, and uses, the lr of its step number
    r = t.train_step(t.batches.shard(0))
    assert r.lr == pytest.approx(3e-3 * 1 / 4)
    assert all(g["lr"] == pytest.approx(3e-3 * 1 / 4) for g in t.optimizer.param_groups)


def test_weight_decay_only_on_matrices(tmp_path):
    t = _trainer(tmp_path, "--train.weight_decay=0.05")
    n = 0
    for opt in t.optimizer:
        decay, no_decay = opt.param_groups
        assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
        assert all(p.ndim >= 2 for p in decay["params"]) and all(p.ndim < 2 for p in no_decay["params"])
        n += len(decay["params"]) + len(no_decay["params"])
    assert n == len(list(t.model.parameters()))


# ---------------------------------------------------------------- gradient clipping and non-finite steps


def _grads_of_one_batch(t: Trainer):
    from loom.train.loss import token_loss_sum

    b = pack_samples(t.batches.shard(0), t.tok.pad_id)
    t.model.zero_grad(set_to_none=True)
    logits = t.model(b.input_ids, b.positions, b.spans, b.modality_inputs)
    (token_loss_sum(logits, b.labels) / b.num_supervised).backward()


def _global_norm(model) -> float:
    return math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters() if p.grad is not None))


def test_clip_reports_the_global_norm_before_clipping(tmp_path):
    t = _trainer(tmp_path)
    _grads_of_one_batch(t)
    pre = _global_norm(t.model)
    assert pre > 0
    norm, finite = clip_and_check(t.model, pre / 7)
    assert finite and norm == pytest.approx(pre, rel=1e-5)


def test_clip_scales_to_max_norm(tmp_path):
    t = _trainer(tmp_path)
    _grads_of_one_batch(t)
    before = {n: p.grad.clone() for n, p in t.model.named_parameters()}
    pre = _global_norm(t.model)
    max_norm = pre / 7
    norm, finite = clip_and_check(t.model, max_norm)
    assert finite and norm == pytest.approx(pre, rel=1e-5)
    assert _global_norm(t.model) == pytest.approx(max_norm, rel=1e-5)
    for n, p in t.model.named_parameters():  # one common factor: directions unchanged
        torch.testing.assert_close(p.grad, before[n] * (max_norm / pre), rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("factor", [2.0, 0.0])  # max_norm above the norm, and 0 (clipping disabled)
def test_clip_leaves_small_grads_alone(tmp_path, factor):
    t = _trainer(tmp_path)
    _grads_of_one_batch(t)
    before = {n: p.grad.clone() for n, p in t.model.named_parameters()}
    pre = _global_norm(t.model)
    norm, finite = clip_and_check(t.model, factor * pre)
    assert finite and norm == pytest.approx(pre, rel=1e-5)
    assert all(torch.equal(p.grad, before[n]) for n, p in t.model.named_parameters())


def test_non_finite_grad_is_reported_and_not_clipped(tmp_path):
    t = _trainer(tmp_path)
    _grads_of_one_batch(t)
    p0 = t.model.language.layers["0"].mlp.up_proj.weight
    p0.grad[0, 0] = float("inf")
    other = t.model.language.norm.weight.grad.clone()
    norm, finite = clip_and_check(t.model, 1e-3)
    assert not finite and not math.isfinite(norm)
    assert torch.equal(t.model.language.norm.weight.grad, other)  # nothing was scaled


def _poison_grad(t: Trainer):
    p = t.model.language.layers["1"].self_attn.v_proj.weight
    return p.register_hook(lambda g: torch.full_like(g, float("nan")))  # as if the backward overflowed


def _poison_input(t: Trainer):
    """An image with an inf pixel: the forward itself turns non-finite."""
    orig = t.batches.transform

    def transform(ex):
        s = orig(ex)
        if s.images:
            s.images[0] = s.images[0].clone()
            s.images[0][0, 0, 0] = float("inf")
        return s

    t.batches.transform = transform

    class Undo:
        def remove(self):
            t.batches.transform = orig

    return Undo()


@pytest.mark.parametrize("poison", [_poison_grad, _poison_input], ids=["nan-grad", "inf-input"])
def test_non_finite_step_is_skipped(tmp_path, poison):
    t = _trainer(tmp_path)
    before = _weights(t.model)
    handle = poison(t)
    r = t.train_step(t.batches.shard(0))
    handle.remove()
    assert r.skipped and not math.isfinite(r.grad_norm)
    after = _weights(t.model)
    assert all(torch.equal(before[k], after[k]) for k in before), "a skipped step changed the weights"
    assert not t.optimizer.state  # AdamW took no step: no moments were created
    assert all(p.grad is None for p in t.model.parameters())  # the bad gradients are not carried over
    # training goes on normally afterwards
    r2 = t.train_step(t.batches.shard(1))
    assert not r2.skipped and math.isfinite(r2.loss)
    assert any(not torch.equal(before[k], v) for k, v in t.model.state_dict().items())


# ---------------------------------------------------------------- bf16


def test_bf16_step(tmp_path):
    fp32 = _trainer(tmp_path / "a")
    bf16 = _trainer(tmp_path / "b", "--train.dtype=bf16")
    before = _weights(bf16.model)
    samples = bf16.batches.shard(0)
    r16, r32 = bf16.train_step(samples), fp32.train_step(samples)
    assert math.isfinite(r16.loss) and not r16.skipped and math.isfinite(r16.grad_norm)
    assert r16.loss == pytest.approx(r32.loss, rel=0.02)  # same model, same data: close to the fp32 loss
    assert r16.loss != r32.loss  # and it really ran in bf16
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())  # fp32 master weights
    assert any(not torch.equal(before[k], v) for k, v in bf16.model.state_dict().items())


# ---------------------------------------------------------------- the CLI end to end


def test_cli_train_end_to_end(tmp_path, capsys):
    out = tmp_path / "run"
    code = loom.cli.main(["train", "configs/tiny.toml", "--train.steps=3", "--data.heldout_size=6",
                          f"--run.out_dir={out}", "--run.tensorboard=false", "--train.eval_max_new_tokens=4"])
    assert code == 0
    assert (out / "latest").read_text().strip() == "step-3" and not (out / "final").exists()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    heldout = [r for r in records if r["kind"] == "heldout"]
    assert [r["step"] for r in train] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) for r in train)
    assert len(heldout) == 1 and heldout[0]["step"] == 3
    for key in ("exact_match", "token_accuracy", "exact_match/digits", "exact_match/shapes", "exact_match/tones"):
        assert 0.0 <= heldout[0][key] <= 1.0
    state = json.loads((out / "step-3" / "state.json").read_text())
    assert state["step"] == 3 and state["config"]["train"]["steps"] == 3
    assert not (out / "tensorboard").exists()
    assert "held-out" in capsys.readouterr().err


def test_an_encoder_without_inputs_still_runs_and_gets_zero_grads():
    """A replica whose samples hold no audio must still run the audio encoder (FSDP collectives need every
    replica in every module) and receive exact-zero gradients from it."""
    from loom.data.format import to_sample
    from loom.data.packing import pack_samples
    from loom.data.tasks import make_example
    from loom.data.tokenizer import ByteTokenizer
    from loom.models.audio import AudioConfig
    from loom.models.llm import LLMConfig
    from loom.models.multimodal import build_model
    from loom.models.vision import VisionConfig

    tok = ByteTokenizer()
    torch.manual_seed(0)
    model = build_model(LLMConfig(hidden_size=32, num_layers=1, intermediate_size=64), VisionConfig(hidden_size=32),
                        AudioConfig(hidden_size=32), tok.placeholder_ids)
    counters = {n: model.encoder(n).num_tokens for n in model.encoder_names}
    ex = make_example("digits", "train", 0, seed=0, patch_size=4, n_audio_features=32)
    batch = pack_samples([to_sample(ex, tok, counters)], tok.pad_id)
    assert batch.modality_inputs["audio"] == []
    calls = []
    model.audio.encoder.register_forward_hook(lambda *_: calls.append("audio"))
    logits = model(batch.input_ids, batch.positions, batch.spans, batch.modality_inputs)
    logits.sum().backward()
    assert calls == ["audio"]
    for name, p in model.audio.named_parameters():
        assert p.grad is not None and torch.count_nonzero(p.grad) == 0, name
    assert any(torch.count_nonzero(p.grad) for p in model.vision.parameters())


def test_module_lr_scale_and_freeze(tmp_path):
    t = _trainer(tmp_path, "--train.steps=40", "--train.warmup_steps=4", "--train.lr=3e-3",
                 "--train.audio.lr_scale=0.1", "--train.vision.freeze=true")
    assert set(t.optimizer.by_module) == {"audio", "language"}  # a frozen module gets no optimizer
    set_lr(t.optimizer, 3, t.cfg.train)
    assert all(g["lr"] == pytest.approx(3e-3 * 0.1) for g in t.optimizer.by_module["audio"].param_groups)
    assert all(g["lr"] == pytest.approx(3e-3) for g in t.optimizer.by_module["language"].param_groups)
    before = {k: v.clone() for k, v in t.model.vision.state_dict().items()}
    t.train_step(t.batches.shard(0))
    assert all(p.grad is None for p in t.model.vision.parameters())
    assert all(torch.equal(v, before[k]) for k, v in t.model.vision.state_dict().items())


def test_default_job_runs_on_four_local_ranks(tmp_path, capsys):
    """`loom train` with no CONFIG starts 4 ranks itself and trains the heterogeneous default layout: the guides'
    short form of it (its first steps; held-out size and generated tokens change no training step), whose loss
    at the last step lands in the band docs/training.md states."""
    steps, low, high = short_form_band("loom train")
    out = tmp_path / "run"
    code = loom.cli.main(["train", f"--train.steps={steps}", "--data.heldout_size=3", f"--run.out_dir={out}",
                          "--run.tensorboard=false", "--train.eval_max_new_tokens=2", "--run.progress=false"])
    assert code == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    assert low <= train[-1]["loss"] <= high, f"loss at step {steps}: {train[-1]['loss']:.4f}, docs: {low}–{high}"
    heldout = [r for r in records if r["kind"] == "heldout"]  # under the layout, on every rank: no generation
    assert len(heldout) == 1 and "token_accuracy" in heldout[0] and "exact_match" not in heldout[0]
    assert (out / "latest").read_text().strip() == f"step-{steps}"
    assert "exact match" in capsys.readouterr().out  # the launcher's `loom eval` of the checkpoint


def test_module_optimizer_state_is_keyed_by_module(tmp_path):
    t = _trainer(tmp_path, "--train.vision.freeze=true")
    t.train_step(t.batches.shard(0))
    state = copy.deepcopy(t.optimizer.state_dict())  # a snapshot: loading may alias the tensors it is given
    assert set(state) == {"audio", "language"}
    fresh, control = (_trainer(tmp_path, "--train.vision.freeze=true") for _ in range(2))
    fresh.optimizer.load_state_dict(state)
    for other in (fresh, control):  # same weights and step; only `fresh` gets the optimizer state
        other.model.load_state_dict(t.model.state_dict())
        other.step = t.step
    for trainer in (t, fresh, control):
        trainer.train_step(trainer.batches.shard(1))
    after, resumed, restarted = _weights(t.model), _weights(fresh.model), _weights(control.model)
    assert all(torch.equal(after[k], v) for k, v in resumed.items())
    assert not all(torch.equal(after[k], v) for k, v in restarted.items())  # the state matters: the check can fail
    with pytest.raises(ValueError, match="this job trains"):
        _trainer(tmp_path).optimizer.load_state_dict(state)


def test_loom_eval_of_a_checkpoint_matches_the_run_s_own_evaluation(tmp_path, capsys):
    """`loom eval` builds the model from the checkpoint's config and files alone and gets the held-out
    metrics the one-process run computed on its own weights after its last step."""
    out = tmp_path / "run"
    final = _trainer(out, "--train.steps=3", "--data.heldout_size=6", "--train.eval_max_new_tokens=4").run()
    assert final and "exact_match" in final
    capsys.readouterr()
    assert loom.cli.main(["eval", str(out), "--device=cpu"]) == 0  # a run folder: its latest checkpoint
    report = capsys.readouterr().out
    assert "step-3 (step 3)" in report
    assert f"{final['exact_match']:6.1%}" in report and f"{final['token_accuracy']:6.1%}" in report
    from loom.train.checkpoint_eval import evaluate_checkpoint

    metrics, step = evaluate_checkpoint(out / "step-3", torch.device("cpu"))
    assert step == 3 and metrics == final


def test_loom_eval_names_the_weights_a_checkpoint_lacks_before_reading_any(tmp_path, capsys, monkeypatch):
    """A checkpoint whose config names a model it does not hold (here one LLM layer more) is refused with the
    missing names and counts, before a tensor is read."""
    import loom.checkpoint.read as read

    out = tmp_path / "run"
    _trainer(out, "--train.steps=1", "--data.heldout_size=2").run()
    state_file = out / "step-1" / "state.json"
    state = json.loads(state_file.read_text())
    layers = state["config"]["model"]["language"]["num_layers"]
    state["config"]["model"]["language"]["num_layers"] = layers + 1
    state_file.write_text(json.dumps(state))
    monkeypatch.setattr(read, "read_one", lambda *a: pytest.fail("a tensor was read before the check"))
    assert loom.cli.main(["eval", str(out / "step-1"), "--device=cpu"]) == 2
    err = capsys.readouterr().err
    assert f"holds no ['language.layers.{layers}." in err and "of the" in err


def test_loom_eval_refuses_a_folder_that_is_no_checkpoint(tmp_path, capsys):
    assert loom.cli.main(["eval", str(tmp_path)]) == 2
    assert "not a complete loom checkpoint" in capsys.readouterr().err
