"""A pipelined LLM equals the one-process reference: loss, grad norms, each module's gradients and weight
updates, on N gloo ranks, for every schedule and with TP/SP, CP (packed), DP and the three-phase step
(colocated encoders feeding the LLM's first stage), with FSDP2 reducing gradients once per step or after
every microbatch. The reference runs the whole global batch at once.
"""

from __future__ import annotations

import pytest
from oracle import assert_all_passed, run_verify

UNTIED = ["--model.language.tie_embeddings=false"]  # a tie across stages is not built (rejected by config)


def pp(p: int, m: int, schedule: str = "1f1b", virtual: int = 1, tokens: int = 512) -> list[str]:
    return UNTIED + [f"--layout.language.pp={p}", f"--train.microbatches={m}", f"--data.tokens_per_microbatch={tokens}",
                     f"--parallel.pp_schedule={schedule}", f"--parallel.pp_virtual_stages={virtual}"]


ENCODERS_DP = ["--layout.vision.tp=1", "--layout.audio.tp=1"]
PER_MICROBATCH = ["--parallel.pp_grad_reduce=microbatch"]

# (world size, overrides); the default model has 4 LLM layers
LAYOUTS = {
    "pp2-1f1b-m2": (2, pp(2, 2)),  # M = pp
    "pp2-1f1b-m4": (2, pp(2, 4, tokens=256)),  # M = 2·pp
    "pp2-gpipe": (2, pp(2, 2, "gpipe")),
    "pp2-interleaved-v2": (2, pp(2, 4, "interleaved_1f1b", 2, tokens=256)),
    "pp2-zero-bubble-v2": (2, pp(2, 4, "zero_bubble", 2, tokens=256)),
    "pp2-zbv": (2, pp(2, 2, "zbv", 2)),
    "pp4-1f1b": (4, pp(4, 4, tokens=256)),
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

    from loom.config import load_config
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
    """Two pipelined training steps, the final checkpoint and the held-out evaluation of `loom train`; returns
    this rank's own LLM weights (whole, gathered over dp) and, on rank 0, what the checkpoint holds."""
    import torch.distributed as dist
    from safetensors.torch import load_file

    from loom.config import load_config
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
    return {"mine": mine, "weights": load_file(f"{out_dir}/final/model.safetensors"),
            "moments": set(load_file(f"{out_dir}/final/optimizer.safetensors"))}


def test_pipelined_run_saves_every_stage(worlds, tmp_path):
    """The checkpoint of a pipelined run holds every stage's weights (as trained) and optimizer moments."""
    per_rank = worlds.run(4, _train_and_save, str(tmp_path), timeout=300)
    saved = per_rank[0]["weights"]
    llm = {k for k in saved if k.startswith("language.")}
    held = [k for r in per_rank for k in r["mine"]]
    assert sorted(set(held)) == sorted(llm)  # every LLM weight, from its own stage
    for r in per_rank:
        for name, tensor in r["mine"].items():
            assert (saved[name] == tensor).all(), name
    assert {f"{k}.exp_avg" for k in llm} <= per_rank[0]["moments"]
