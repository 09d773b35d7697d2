"""A pipelined LLM equals the one-process reference: loss, grad norms, each module's gradients and weight
updates, on N gloo ranks, for every schedule and with TP/SP, CP (packed), DP and the three-phase step
(colocated encoders feeding the LLM's first stage), with FSDP2 reducing gradients once per step or after
every microbatch. The model ties its embedding to the LM head (the default) unless a case says otherwise: the
stage-0 and last-stage copies must add up to the reference's one gradient. The reference runs the whole
global batch at once.
"""

from __future__ import annotations

import pytest
from oracle import assert_all_passed, run_verify

UNTIED = ["--model.language.tie_embeddings=false"]


def pp(p: int, m: int, schedule: str = "1f1b", virtual: int = 1, tokens: int = 512) -> list[str]:
    return [f"--layout.language.pp={p}", f"--train.microbatches={m}", f"--data.tokens_per_microbatch={tokens}",
            f"--parallel.pp_schedule={schedule}", f"--parallel.pp_virtual_stages={virtual}"]


ENCODERS_DP = ["--layout.vision.tp=1", "--layout.audio.tp=1"]
PER_MICROBATCH = ["--parallel.pp_grad_reduce=microbatch"]

# (world size, overrides); the default model has 4 LLM layers
LAYOUTS = {
    "pp2-1f1b-m2": (2, pp(2, 2)),  # M = pp
    "pp2-1f1b-m4-untied": (2, pp(2, 4, tokens=256) + UNTIED),  # M = 2·pp; the head its own weight
    "pp2-gpipe": (2, pp(2, 2, "gpipe")),
    "pp2-interleaved-v2": (2, pp(2, 4, "interleaved_1f1b", 2, tokens=256)),
    "pp2-zero-bubble-v2": (2, pp(2, 4, "zero_bubble", 2, tokens=256)),
    "pp2-zbv": (2, pp(2, 2, "zbv", 2)),  # rank 0 holds stage 0 and the last stage: both copies, added locally
    "pp4-1f1b": (4, pp(4, 4, tokens=256)),  # the middle stages hold neither copy
    # vocab-parallel embedding and column-wise head: both copies Shard(0) over tp
    "pp2xtp2-sp": (4, pp(2, 2) + ["--layout.language.tp=2", "--layout.language.sequence_parallel=true"]),
    "pp2xcp2-packed": (4, pp(2, 2) + ["--layout.language.cp=2"]),
    "pp2xdp2": (4, pp(2, 2) + ENCODERS_DP),
    # FSDP2 reduce-scatters (and reshards) after every microbatch's backward instead of once per step
    "pp2xdp2-m4-grad-per-microbatch": (4, pp(2, 4, tokens=256) + ENCODERS_DP + PER_MICROBATCH),
    "pp2xcp2-grad-per-microbatch": (4, pp(2, 2) + ["--layout.language.cp=2"] + PER_MICROBATCH),
    # the three-phase step: encoders on every rank, their rows to the LLM's stage-0 ranks
    "encoders-dp4-llm-pp2xdp2": (4, pp(2, 4, tokens=256) + ENCODERS_DP),
    "encoders-tp2xdp2-llm-pp2xtp2": (4, pp(2, 2) + ["--layout.vision.tp=2", "--layout.audio.tp=2",
                                                    "--layout.language.tp=2"]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_pipeline_matches_reference(worlds, name):
    world, overrides = LAYOUTS[name]
    per_rank = worlds.run(world, run_verify, overrides, 2, timeout=300)
    assert_all_passed(name, per_rank, 2)


def _reductions_in_one_step(grad_reduce: str) -> dict[str, int]:
    """One pipelined training step; how many times FSDP2 reduced each of this rank's LLM parameter groups."""
    import torch.distributed as dist
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as param_group

    from loom.job import load_config
    from loom.train.trainer import Trainer

    cfg = load_config(None, ["--train.global_batch_size=8", "--data.train_size=200"] + pp(2, 4, tokens=256)
                      + [f"--parallel.pp_grad_reduce={grad_reduce}"], world_size=dist.get_world_size())
    trainer = Trainer(cfg)
    llm = {id(p): name for name, p in trainer.model.language.named_parameters()}
    counts: dict[str, int] = {}
    original = param_group.foreach_reduce

    def counting(fsdp_params, *args, **kwargs):
        name = llm.get(id(fsdp_params[0].sharded_param))  # a group named by its first parameter
        if name is not None:
            counts[name] = counts.get(name, 0) + 1
        return original(fsdp_params, *args, **kwargs)

    param_group.foreach_reduce = counting
    try:
        trainer.train_step()
    finally:
        param_group.foreach_reduce = original
    return counts


@pytest.mark.parametrize("grad_reduce,per_step", [("step", 1), ("microbatch", 4)])
def test_pipeline_reduces_gradients_once_per_step_or_per_microbatch(worlds, grad_reduce, per_step):
    """M = 4: "step" reduces each LLM parameter group once, "microbatch" once after each microbatch — never
    a second time at the schedule's end (parity alone cannot tell the two apart)."""
    per_rank = worlds.run(2, _reductions_in_one_step, grad_reduce, timeout=300)
    for rank, counts in enumerate(per_rank):
        assert counts, f"rank {rank}: no LLM gradient reduction seen"
        assert set(counts.values()) == {per_step}, f"rank {rank}: {counts}"


def _train_and_save(out_dir: str) -> dict:
    """Two pipelined training steps of the tied model, the last checkpoint, its Hugging Face export and the
    held-out evaluation of `loom train`; returns this rank's own LLM weights (whole, gathered over dp) and, on
    rank 0, what the checkpoint and the export hold and what a one-process checkpoint of the model would name."""
    import json

    import torch.distributed as dist
    from conftest import saved_tensors
    from safetensors.torch import load_file

    from loom.job import load_config
    from loom.data.tokenizer import ByteTokenizer
    from loom.models.hf.export import export_checkpoint
    from loom.train.build import build_job_model
    from loom.checkpoint.sharded import tied_aliases
    from loom.train.trainer import Trainer
    from loom.train.verify import parameters

    cfg = load_config(None, ["--train.global_batch_size=8", "--data.train_size=200", "--data.heldout_size=4",
                             "--train.steps=2", "--run.tensorboard=false", "--run.progress=false",
                             f"--run.out_dir={out_dir}", "--train.eval_max_new_tokens=2"]
                      + pp(2, 2) + ENCODERS_DP, world_size=dist.get_world_size())
    trainer = Trainer(cfg)
    trainer.run()
    mine = {k: v for k, v in parameters(trainer.model).items() if k.startswith("language.")}
    if dist.get_rank() != 0:
        return {"mine": mine}
    one_process = build_job_model(cfg, ByteTokenizer())  # what `loom train` on one process would save (names)
    hf = export_checkpoint(f"{out_dir}/step-2", f"{out_dir}/hf")["language"]
    weights, moments = saved_tensors(f"{out_dir}/step-2")
    return {"mine": mine, "weights": weights, "moments": moments,
            "one_process_weights": set(one_process.state_dict()) - set(tied_aliases(one_process)),
            "one_process_moments": {f"{n}.{k}" for n, _ in one_process.named_parameters()
                                    for k in ("exp_avg", "exp_avg_sq", "step")},
            "hf_tensors": set(load_file(hf / "model.safetensors")),
            "hf_tied": json.loads((hf / "config.json").read_text())["tie_word_embeddings"]}


def test_pipelined_run_saves_every_stage(worlds, tmp_path):
    """The checkpoint of a pipelined run (pp2·dp2, tied) holds every stage's weights as trained and their
    optimizer moments, under exactly the names a one-process checkpoint has: the tie stored once, as the
    embedding, which after two steps is bitwise the head's copy; `loom export` writes a tied HF folder."""
    per_rank = worlds.run(4, _train_and_save, str(tmp_path), timeout=300)
    first = per_rank[0]
    saved = first["weights"]
    assert set(saved) == first["one_process_weights"] and first["moments"] == first["one_process_moments"]
    head, embedding = "language.lm_head.weight", "language.embed_tokens.weight"
    held = [k for r in per_rank for k in r["mine"]]
    llm = {k for k in saved if k.startswith("language.")}
    assert sorted(set(held)) == sorted(llm | {head})  # every LLM weight from its own stage, and the head copy
    for r in per_rank:
        for name, tensor in r["mine"].items():
            assert (saved[embedding if name == head else name] == tensor).all(), name  # the copies: bitwise
    assert sum(head in r["mine"] for r in per_rank) == 2  # the last stage's two dp ranks
    assert first["hf_tied"] is True and not any(k.startswith("lm_head") for k in first["hf_tensors"])


def _tied_copies_after_steps(steps: int) -> dict:
    """zbv on 2 ranks: rank 0 holds stage 0 and the last stage, so both copies of the tied embedding."""
    import torch.distributed as dist

    from loom.job import load_config
    from loom.train.trainer import Trainer
    from loom.train.verify import parameters

    cfg = load_config(None, ["--train.global_batch_size=8", "--data.train_size=200"] + pp(2, 2, "zbv", 2),
                      world_size=dist.get_world_size())
    trainer = Trainer(cfg)
    lm = trainer.model.language
    before = parameters(lm)  # whole tensors
    for _ in range(steps):
        trainer.train_step()
    after = parameters(lm)
    if 0 not in lm.indices:
        return {}
    return {"embedding": after["embed_tokens.weight"], "head": after["lm_head.weight"],
            "before": before["embed_tokens.weight"], "separate": lm.lm_head.weight is not lm.embed_tokens.weight}


def test_zbv_tied_copies_on_one_rank_stay_bitwise_equal(worlds):
    per_rank = worlds.run(2, _tied_copies_after_steps, 2, timeout=300)
    r = per_rank[0]
    assert r["separate"]  # two parameters (two FSDP2 roots), not one shared
    assert not (r["embedding"] == r["before"]).all()  # trained
    assert (r["embedding"] == r["head"]).all()
    assert per_rank[1] == {}
