"""Encoders and the LLM on disjoint ranks equal the one-process reference: loss, grad norms, each module's
gradients and weight updates, on N gloo ranks — the point-to-point bridge (equal, fan-in, fan-out, LLM tp/cp
on the receiving side), the encoder ranks' 1F1B-style loop, and one optimizer step across the grids.
"""

from __future__ import annotations

import pytest
from oracle import assert_all_passed, run_verify


def placed(encoders: str, llm: str, m: int = 2, tokens: int = 512, **degrees: int) -> list[str]:
    """Vision and audio on rank range `encoders`, the LLM on `llm`; `degrees`: e.g. vision_tp=2, language_cp=2."""
    out = [f"--layout.vision.ranks={encoders}", f"--layout.audio.ranks={encoders}", f"--layout.language.ranks={llm}",
           f"--train.microbatches={m}", f"--data.tokens_per_microbatch={tokens}"]
    return out + [f"--layout.{key.replace('_', '.')}={value}" for key, value in degrees.items()]


# (world size, overrides)
LAYOUTS = {
    "vision-tp2-llm-dp2": (4, placed("0-1", "2-3", vision_tp=2)),  # equal: one encoder replica… per LLM replica
    "encoders-dp2-llm-dp1-fan-in": (3, placed("0-1", "2-2")),
    "encoders-dp1-llm-dp2-fan-out-m4": (3, placed("0-0", "1-2", m=4, tokens=256)),
    "llm-cp2-receives": (3, placed("0-0", "1-2", language_cp=2)),
    "llm-tp2-receives": (3, placed("0-0", "1-2", language_tp=2)),
    # one multi-module pipeline: encoder stage, then the LLM's stages
    "llm-pp2-1f1b-m2": (3, placed("0-0", "1-2", language_pp=2)),
    "encoders-tp2-llm-pp3xtp2-m4": (8, placed("0-1", "2-7", m=4, tokens=256, vision_tp=2, language_pp=3,
                                              language_tp=2)),
    # the encoders pipelined on ranks of their own: stage 0 on rank 0, the last (projector, bridge) on rank 1
    "encoders-pp2-llm-dp2": (4, placed("0-1", "2-3", vision_pp=2, audio_pp=2)),
    "encoders-pp2-llm-pp2-1f1b": (4, placed("0-1", "2-3", vision_pp=2, audio_pp=2, language_pp=2)),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_noncolocated_matches_reference(worlds, name):
    world, overrides = LAYOUTS[name]
    per_rank = worlds.run(world, run_verify, overrides, 2, timeout=300)
    assert_all_passed(name, per_rank, 2)


def _train_and_save(out_dir: str) -> dict:
    """Two non-colocated training steps, the last checkpoint and the held-out evaluation of `loom train`;
    returns this rank's own weights (whole) and, on rank 0, what the checkpoint holds."""
    import torch.distributed as dist
    from conftest import saved_tensors

    from loom.job import load_config
    from torch.distributed.tensor import DTensor

    from loom.train.trainer import Trainer

    cfg = load_config(None, ["--train.global_batch_size=8", "--data.train_size=200", "--data.heldout_size=4",
                             "--train.steps=2", "--run.tensorboard=false", "--run.progress=false",
                             f"--run.out_dir={out_dir}", "--train.eval_max_new_tokens=2"]
                      + placed("0-0", "1-2"), world_size=dist.get_world_size())
    trainer = Trainer(cfg)
    final = trainer.run()
    mine = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in trainer.model.state_dict().items()}
    out = {"mine": mine, "modules": [n for n, _ in trainer.model.named_children()], "final": final,
           "names": trainer.weight_names, "params": [n for n, _ in trainer.model.named_parameters()]}
    if dist.get_rank() == 0:
        weights, moments = saved_tensors(f"{out_dir}/step-2")
        out |= {"weights": weights, "moments": moments}
    return out


def test_noncolocated_run_keeps_hosted_modules_and_saves_all(worlds, tmp_path):
    """Each rank holds only its modules; the checkpoint holds every module's weights as trained on its own
    ranks, with their optimizer moments; every rank gets the held-out metrics computed under the layout."""
    per_rank = worlds.run(3, _train_and_save, str(tmp_path), timeout=300)
    assert sorted(per_rank[0]["modules"]) == ["audio", "vision"]
    assert [r["modules"] for r in per_rank[1:]] == [["language"], ["language"]]
    saved = per_rank[0]["weights"]
    assert set(saved) == per_rank[0]["names"]  # every weight of the model, a tied alias once
    for r in per_rank:
        for name, tensor in r["mine"].items():
            if name in saved:
                assert (saved[name] == tensor).all(), name
    assert {f"{k}.exp_avg" for r in per_rank for k in r["params"]} <= per_rank[0]["moments"]
    # held-out loss and token accuracy under the layout, the same on every rank (generation: `loom eval`)
    assert all(r["final"] == per_rank[0]["final"] for r in per_rank) and "token_accuracy" in per_rank[0]["final"]


def _p2p_log(overrides: list[str]) -> list[tuple]:
    """One non-colocated training step with every point-to-point call of the bridge (and between a pipelined
    encoder's stages) recorded on this rank:
    (direction, group, peer, tag, rows) in the order they were posted."""
    import torch.distributed as dist

    from loom.job import load_config
    from loom.train.trainer import Trainer

    cfg = load_config(None, ["--train.global_batch_size=8", "--data.train_size=200"] + overrides,
                      world_size=dist.get_world_size())
    import loom.bridge.p2p as p2p
    import loom.parallel.stage_link as stage_link

    trainer = Trainer(cfg)
    log = []

    class Recording:  # the bridge's view of torch.distributed (the pipeline's own P2P stays untouched)
        def __getattr__(self, name):
            return getattr(dist, name)

        def isend(self, tensor, peer, group=None, tag=0):
            log.append(("send", "rows" if group is dist.group.WORLD else "grads", peer, tag, tensor.shape[0]))
            return dist.isend(tensor, peer, group, tag=tag)

        def irecv(self, tensor, peer, group=None, tag=0):
            log.append(("recv", "rows" if group is dist.group.WORLD else "grads", peer, tag, tensor.shape[0]))
            return dist.irecv(tensor, peer, group, tag=tag)

    p2p.dist = stage_link.dist = Recording()  # the bridge's messages and those between encoder stages
    try:
        trainer.train_step()
    finally:
        p2p.dist = stage_link.dist = dist
    return log


ORDER_CASES = {
    "fan-in": LAYOUTS["encoders-dp2-llm-dp1-fan-in"],
    "fan-out-m4": LAYOUTS["encoders-dp1-llm-dp2-fan-out-m4"],
    "llm-pp2-1f1b-m4": (3, placed("0-0", "1-2", m=4, tokens=256, language_pp=2)),
    "llm-pp2-gpipe-m2": (3, placed("0-0", "1-2", language_pp=2) + ["--parallel.pp_schedule=gpipe"]),
    # encoder stage 0 → its last stage (every activation, then the gradients) → the LLM's 1F1B stage 0
    "encoders-pp2-llm-pp2-1f1b-m4": (4, placed("0-1", "2-3", m=4, tokens=256, vision_pp=2, audio_pp=2,
                                               language_pp=2)),
}


@pytest.mark.parametrize("name", list(ORDER_CASES))
def test_bridge_messages_are_launched_in_the_same_order_on_both_sides(worlds, name):
    """NCCL matches a pair's messages by launch order, and a GPU may run its NCCL kernels in launch order, so
    for every pair of ranks the messages between them (rows and gradients, both groups) must be launched in
    one order on both sides, with the same sizes. Gloo, which CI runs, matches by tag: parity cannot show it."""
    world, overrides = ORDER_CASES[name]
    logs = worlds.run(world, _p2p_log, overrides, timeout=300)
    between: dict[tuple[int, int], list] = {}  # (this rank, peer) → the messages, in launch order
    for rank, log in enumerate(logs):
        for direction, group, peer, tag, rows in log:
            src, dst = (rank, peer) if direction == "send" else (peer, rank)
            between.setdefault((rank, peer), []).append((src, dst, group, tag, rows))
    assert between
    for (rank, peer), messages in between.items():
        assert messages == between.get((peer, rank)), f"ranks {rank} and {peer} launch their messages differently"
