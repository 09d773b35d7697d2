"""A rank's host cost at 64 to 8,192 ranks, one process posing as rank R of a world of W (issue 50, target 4).

    python bench/scale_sim.py --job mm2b --world 1024 [--rank R] [--steps 3]
    python bench/scale_sim.py --table [--worlds 64 1024 8192]   # each (job, world) in a fresh process

The fake backend (`init_process_group("fake")`) answers every collective at once without data, so what is
timed is this rank's own host work: start-up (the tokenizer and the model on the meta device; the data; the
topology, its process groups and the layouts applied to the meta model — `setup_parallel` without weights:
nothing is materialised) and each step's planning (`draw`: the shapes of the samples of this rank's planning
cells looked up, and the whole batch's totals; `plan_step`: that plus the cells' bins, this rank's microbatches, its
samples rendered and its media decoded; `render_s`, the part of `plan_step` spent rendering this rank's samples —
the built-in tasks drawing their images and clips, set by which samples the rank takes, not by the world — and
`planning_s` the rest; `cells`: the planning cells it plans, of how many, train/plan_cells.py). Each phase is one
function of loom's, called as loom calls it, so the figures follow the code. The per-rank batch is fixed: the
global batch grows with the LLM's dp. Memory is the process's resident set after start-up and after the steps, less its
size before start-up (after imports); groups are those the registry holds for this rank (`held`), the world
calls it made and how many held groups have one rank (none: a rank alone gets a stand-in); `meshes`: the live
DeviceMesh objects, `rank_map_copies`: the rank-map tuples they hold (one per distinct map when shared:
topology/rank_maps.py). bench/scale_mem.py says what holds the resident set.

Jobs: "mm2b" — the 2B multimodal workload (bench/mm_bench.py's LLM + ViT + audio encoder) in the default
config's layout shape (vision tp2·dp, audio dp, LLM dp); "deepseek" — a DeepSeek-V3-sized LLM (61 layers of
width 7168, MLA, 256 experts of width 2048, 8 per token, 3 dense layers) at pp16 and ep64 (ep = dp·cp where
that is below 64: at 64 ranks dp·cp is 4), with the tiny encoders on every rank; "mm2b-hsdp8" — mm2b with every
module under HSDP in runs of 8 ranks (`[layout.<module>] shard = 8`).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time

JOBS = {
    "mm2b": {"per_replica": 2, "overrides": [
        "--model.language.hidden_size=1536", "--model.language.num_layers=28", "--model.language.num_heads=12",
        "--model.language.num_kv_heads=2", "--model.language.intermediate_size=8960",
        "--model.language.vocab_size=151936", "--model.language.attention_bias=true",
        "--model.vision.hidden_size=1152", "--model.vision.num_layers=27", "--model.vision.num_heads=16",
        "--model.vision.intermediate_size=4304", "--model.vision.patch_size=14", "--model.vision.position_grid=27",
        "--model.audio.num_features=80", "--model.audio.hidden_size=384", "--model.audio.num_layers=4",
        "--model.audio.num_heads=6", "--model.audio.intermediate_size=1536",
        "--layout.vision.tp=2", "--layout.audio.tp=1", "--layout.language.tp=1"]},
    "deepseek": {"per_replica": 16, "pp": 16, "ep": 64, "overrides": [
        "--model.language.vocab_size=129280", "--model.language.hidden_size=7168", "--model.language.num_layers=61",
        "--model.language.num_heads=128", "--model.language.num_kv_heads=128",
        "--model.language.intermediate_size=18432", "--model.language.q_lora_rank=1536",
        "--model.language.kv_lora_rank=512", "--model.language.qk_nope_head_dim=128",
        "--model.language.qk_rope_head_dim=64", "--model.language.v_head_dim=128",
        "--model.language.rope_interleave=true", "--model.language.num_experts=256",
        "--model.language.num_experts_per_tok=8", "--model.language.moe_intermediate_size=2048",
        "--model.language.first_k_dense_replace=3", "--model.language.router_score=sigmoid",
        "--model.language.n_group=8", "--model.language.topk_group=4", "--model.language.routed_scaling_factor=2.5",
        "--model.language.n_shared_experts=1", "--model.language.tie_embeddings=false",
        "--layout.language.pp=16", "--train.microbatches=16", "--data.tokens_per_microbatch=1024"]},
}
# the 2B job under HSDP (`shard = 8`, parallel/hsdp.py): every module's FSDP2 over runs of 8 of its dp·cp ranks
JOBS["mm2b-hsdp8"] = {**JOBS["mm2b"], "overrides": JOBS["mm2b"]["overrides"] + [
    f"--layout.{m}.shard=8" for m in ("vision", "audio", "language")]}


def job_config(job: str, world: int):
    """The job at `world` ranks: its LLM's dp replicas each take `per_replica` samples a step."""
    from loom.job import load_config

    spec = JOBS[job]
    dp = world // spec.get("pp", 1)
    extra = [f"--layout.language.ep={min(spec['ep'], dp)}"] if "ep" in spec else []
    return load_config(None, spec["overrides"] + extra + [f"--train.global_batch_size={spec['per_replica'] * dp}"],
                       world_size=world)


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def timed(fn, *args, **kwargs):
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0


def timing(spent: dict, key: str, owner, name: str) -> None:
    """`owner.name` (a module's function, as its callers find it) adds its wall time to spent[key]."""
    fn = getattr(owner, name)

    def timed_fn(*args, **kwargs):
        out, seconds = timed(fn, *args, **kwargs)
        spent[key] = spent.get(key, 0.0) + seconds
        return out

    setattr(owner, name, timed_fn)


def stand_in_gather() -> dict:
    """The start-up's shape table (data/shape_table.py): this rank measures its share (timed, `share_s`); the fake
    backend gathers nothing, so every item is measured here in its place and left out of the time (`untimed_s`);
    `mib`: the table's arrays, what the all_gather brings each rank."""
    from loom.data import shape_table

    found = {"share_s": 0.0, "untimed_s": 0.0, "mib": 0.0}
    share, table = shape_table.ShapeTable.share, {}

    def timed_share(self, rank, world):
        table["it"] = self
        out, found["share_s"] = timed(share, self, rank, world)
        return out

    def everyone(mine, world):
        everything, found["untimed_s"] = timed(share, table["it"], 0, 1)
        arrays = everything[1]
        found["mib"] = sum(a.nbytes for a in (arrays.tokens, arrays.targets, arrays.field_set, *arrays.offsets.values(),
                                              *arrays.rows.values())) / 2**20
        return [everything]

    shape_table.ShapeTable.share, shape_table.gathered = timed_share, everyone
    return found


def simulate(job: str, world: int, rank: int, steps: int) -> dict:
    """In this process: rank `rank` of a fake `world`-rank world starts `job` and plans `steps` steps."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from loom.topology import Topology, groups
    from loom.topology.layout import resolve_placement
    from loom.topology.rank_maps import rank_map_copies
    from loom.train import rank_plan
    from loom.train.job_data import build_job_data, job_tokenizer, with_vocabulary
    from loom.train.job_model import build_batches, build_job_model, token_counters
    from loom.train.rank_plan import _rank_plan  # setup_parallel without materialize: the layouts on meta
    from loom.train.step_data import draw, plan_step

    cfg = job_config(job, world)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    base, device, start = rss_mib(), torch.device("cpu"), {}
    tok, start["tokenizer_s"] = timed(job_tokenizer, cfg)
    cfg = with_vocabulary(cfg, tok)
    model, start["model_on_meta_s"] = timed(build_job_model, cfg, tok)
    counters = token_counters(model)
    placement = resolve_placement(cfg, world)
    inner: dict[str, float] = {}  # _rank_plan's parts: the groups (grids' and named) and the layouts
    timing(inner, "groups_s", Topology, "build")
    timing(inner, "groups_s", rank_plan, "tied_embedding_group")
    timing(inner, "groups_s", rank_plan, "add_expert_groups")
    timing(inner, "layouts_s", rank_plan, "parallelize")
    plan, seconds = timed(_rank_plan, model, cfg, device, [*model.encoder_names, "language"], placement)
    start.update(inner, seams_s=seconds - sum(inner.values()))
    stand_in = stand_in_gather()
    data, start["data_s"] = timed(build_job_data, cfg, tok, counters, plan.sample_multiple)
    start["data_s"] -= stand_in["untimed_s"]  # the other ranks' measuring, done here only for want of a gather
    batches = build_batches(cfg, data)
    after_start = rss_mib()
    # step 0 pays first-call costs (the tasks' cached fonts and clips): timed apart; then each phase on steps of
    # its own, so neither finds the other's work done
    first = timed(plan_step, batches, 0, cfg, tok, counters, plan.shares, plan.sample_multiple)[1]
    step = {"draw_s": [], "plan_step_s": [], "render_s": [], "planning_s": []}
    rendering: dict[str, float] = {}
    timing(rendering, "s", batches, "item")  # the rank's samples rendered (each once a step: then cached)
    for s in range(1, steps + 1):
        drawn, seconds = timed(draw, batches, s, cfg, counters, plan.sample_multiple, plan.shares)
        step["draw_s"].append(seconds)
        rendering["s"] = 0.0
        step["plan_step_s"].append(timed(plan_step, batches, steps + s, cfg, tok, counters, plan.shares,
                                         plan.sample_multiple)[1])
        step["render_s"].append(rendering["s"])
        step["planning_s"].append(step["plan_step_s"][-1] - rendering["s"])
    after_steps = rss_mib()  # before the count below, whose list of every object would add to it
    held = list(groups._ALL)
    meshes = [o for o in gc.get_objects() if isinstance(o, DeviceMesh)]  # FSDP2 makes them per parameter
    out = {"bench": "scale_sim", "job": job, "world": world, "rank": rank, "torch": torch.__version__,
           "layout": placement.layouts["language"].describe(), "global_batch": cfg.train.global_batch_size,
           "startup_s": round(sum(start.values()), 3), **{k: round(v, 3) for k, v in start.items()},
           "first_step_s": round(first, 3), **{k: round(statistics.median(v), 5) for k, v in step.items()},
           "cells": f"{len(drawn.batch.planned)} of {len(drawn.batch.cells)}",
           "shapes_share_s": round(stand_in["share_s"], 3), "shape_table_mib": round(stand_in["mib"], 2),
           "rss_startup_mib": round(after_start - base, 1), "rss_after_steps_mib": round(after_steps - base, 1),
           "groups_held": plan.topo.registry.held(), "world_calls": plan.topo.registry.created,
           "single_rank_groups": sum(g.size() == 1 for g in held), "held_sizes": sorted(g.size() for g in held),
           "meshes": len(meshes), "rank_map_copies": rank_map_copies(meshes)}
    groups.GroupRegistry.destroy_all()
    dist.destroy_process_group()
    return out


def table(worlds: list[int], steps: int) -> None:
    """Every job at every world size, each in a fresh process (start-up and memory from a clean slate)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for job in JOBS:
        for world in worlds:
            out = subprocess.run([sys.executable, __file__, "--job", job, "--world", str(world), "--steps",
                                  str(steps)], capture_output=True, text=True, env=env)
            if out.returncode:
                sys.exit(out.stderr[-4000:])
            print(out.stdout.strip().splitlines()[-1], flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--job", choices=list(JOBS), default="mm2b")
    p.add_argument("--world", type=int, default=64)
    p.add_argument("--rank", type=int, default=0, help="the rank this process plays")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--table", action="store_true", help="every job at every --worlds, one process each")
    p.add_argument("--worlds", type=int, nargs="+", default=[64, 1024, 8192])
    args = p.parse_args()
    if args.table:
        table(args.worlds, args.steps)
    else:
        print(json.dumps(simulate(args.job, args.world, args.rank, args.steps)), flush=True)


if __name__ == "__main__":
    main()
