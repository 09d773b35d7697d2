"""A pipelined LLM equals the one-process reference: loss, grad norms, each module's gradients and weight
updates, on N gloo ranks, for every schedule and with TP/SP, CP (packed), DP and the three-phase step
(colocated encoders feeding the LLM's first stage). The reference runs the whole global batch at once.
"""

from __future__ import annotations

import pytest
from oracle import assert_all_passed, run_verify

UNTIED = ["--model.language.tie_embeddings=false"]  # a tie across stages is not built (rejected by config)


def pp(p: int, m: int, schedule: str = "1f1b", virtual: int = 1, tokens: int = 512) -> list[str]:
    return UNTIED + [f"--layout.language.pp={p}", f"--train.microbatches={m}", f"--data.tokens_per_microbatch={tokens}",
                     f"--parallel.pp_schedule={schedule}", f"--parallel.pp_virtual_stages={virtual}"]


ENCODERS_DP = ["--layout.vision.tp=1", "--layout.audio.tp=1"]

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
