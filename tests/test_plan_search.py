"""`loom plan --search`: the enumeration (what loom accepts, nothing else), the memory filter, the written config,
the cost model's terms by hand, and the CLI end to end on the tiny model — no process started, no timing asserted."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from loom.cli import DEFAULT_CONFIG, main
from loom.job import load_config
from loom.plan_search.calibration import Calibration, Link, load_calibration, save_calibration
from loom.plan_search.cost import (ModuleLayout, ModuleSizes, Settings, Workload, activation_bytes_per_token_layer,
                                   collective_s, fsdp_bytes, module_costs, pipeline_bubble)
from loom.plan_search.estimate import estimate, estimate_steps
from loom.plan_search.report import chosen_config_text
from loom.plan_search.search import (GIB, MEMORY_HEADROOM, checkpointing_modes, enumerate_candidates, search,
                                     settings_of, validate)
from loom.plan_search.workload import JobFacts, module_sizes
from loom.topology import Topology
from loom.train.job_data import job_tokenizer, with_vocabulary
from loom.train.job_model import build_job_model
from loom.typed_config import ConfigError

CONFIG = str(DEFAULT_CONFIG)


def unit_calibration(**kw) -> Calibration:
    """1 FLOP/s, 1 byte/s, no latency, no host: a term's seconds are its FLOPs or bytes."""
    links = {k: {g: Link(0.0, 1.0) for g in (2, 4, 8)} for k in ("all_gather", "all_reduce")}
    fields = dict(device="unit", matmul_flops_per_s=1.0, memory_bytes_per_s=1.0, overhead_per_layer_s=0.0,
                  overhead_per_microbatch_s=0.0, host_overlaps_device=False, memory_reserved_bytes=0.0,
                  collectives=links)
    return Calibration(**{**fields, **kw})


def cpu_calibration() -> Calibration:
    """Rates of the order of a shared CPU's (the search's ranking, not its seconds, is what the tests read)."""
    links = {k: {g: Link(2e-3, 4e8) for g in (2, 4, 8)} for k in ("all_gather", "all_reduce")}
    return Calibration("test cpu", 1e10, 1e9, 5e-3, 5e-3, False, 0.5 * GIB, links)


@pytest.fixture(scope="module")
def tiny():
    """The default job's config, its sizes, and a fixed step of data (no data set read: lengths by hand)."""
    cfg = load_config(CONFIG)
    tok = job_tokenizer(cfg)
    sizes = module_sizes(build_job_model(with_vocabulary(cfg, tok), tok))
    lengths = tuple([20, 28, 35, 40, 45, 50, 55, 58] * 8)  # 64 samples, as default.toml's global batch
    work = Workload(lengths, {"vision": (16,) * 40, "audio": (12,) * 24})
    return cfg, JobFacts(sizes, (work,), {"task 'shapes'": 58})


# ---------------------------------------------------------------- the enumeration


def test_every_candidate_shown_is_accepted_by_loom(tiny):
    cfg, facts = tiny
    result = search(CONFIG, [], cfg, facts, 4, cpu_calibration(), top=25)
    assert len(result.ranked) == 25
    for r in result.ranked:
        c = r.candidate
        loaded = load_config(CONFIG, c.overrides(), 4)  # raises if loom refuses it
        topo = Topology.plan(loaded, 4)
        for name, lay in c.layouts.items():
            got = topo.placement.layouts[name]
            assert (got.tp, got.cp, got.pp, got.dp, got.ep, got.start) == (lay.tp, lay.cp, lay.pp, lay.dp, lay.ep,
                                                                           lay.start)
        assert loaded.train.microbatches == c.microbatches
    times = [r.estimate.tokens_per_s for r in result.ranked]
    assert times == sorted(times, reverse=True)


def test_layouts_loom_refuses_are_left_out(tiny):
    """3 ranks: tp = 3 divides none of the tiny model's heads; loom refuses it, so the search never shows it."""
    cfg, facts = tiny
    result = search(CONFIG, [], cfg, facts, 3, cpu_calibration(), top=40)
    assert result.ranked and sum(result.refused.values()) > 0
    assert all(lay.tp != 3 for r in result.ranked for lay in r.candidate.layouts.values())
    bad = next(c for c in enumerate_candidates(["vision", "audio", "language"], 3, [0], 0)
               if c.layouts["language"].tp == 3)
    with pytest.raises(ConfigError, match="tp = 3"):
        validate(CONFIG, [], bad, facts)


def test_encoder_pipelines_are_proposed_on_ranks_of_their_own_only(tiny):
    """Encoder pp > 1 only where loom builds it (encoders apart from the LLM), never encoder cp; such a
    candidate loom accepts is priced with the encoder's own bubble."""
    cfg, facts = tiny
    candidates = list(enumerate_candidates(["vision", "audio", "language"], 8, [0, 1024], 0))
    encoders = [(c.layouts[n], c.layouts["language"].start) for c in candidates for n in ("vision", "audio")]
    assert all(lay.cp == 1 for lay, _ in encoders)
    assert all(lay.pp == 1 for lay, llm_start in encoders if llm_start == 0)  # colocated
    piped = next(c for c in enumerate_candidates(["vision", "audio", "language"], 4, [0], 0)
                 if c.layouts["vision"].pp == 2 and c.layouts["audio"].pp == 2 and c.layouts["language"].start == 2
                 and c.layouts["language"].dp == 2 and c.microbatches == 2)
    validate(CONFIG, [], piped, facts)  # loom accepts it


def test_an_encoder_pipeline_stretches_by_its_own_bubble():
    """Encoders on 2 ranks of their own, pp2 against dp2 (the same compute per rank): pp2's compute is
    stretched by its GPipe bubble, (pp − 1)/(M + pp − 1) = 1/3 at M = 2, and it sends activations."""
    cal = unit_calibration()
    enc = replace(SIZES, name="vision", vocab=0, causal=False, out_width=8)
    sizes, work = {"vision": enc, "language": SIZES}, Workload((10,) * 4, {"vision": (500,) * 4})
    llm, s = ModuleLayout(dp=1, start=2), Settings(microbatches=2)
    flat = estimate(sizes, {"vision": ModuleLayout(dp=2), "language": llm}, s, work, cal)
    piped = estimate(sizes, {"vision": ModuleLayout(pp=2, dp=1), "language": llm}, s, work, cal)
    assert "pp" not in flat.seconds and piped.seconds["pp"] > 0  # the encoder's side is the slower here
    assert piped.seconds["compute"] == pytest.approx(flat.seconds["compute"] * 1.5)


def test_batches_that_do_not_fit_their_bins_are_left_out(tiny):
    """T = 64 with M = 1 on dp4 holds 256 tokens: the step's 2,648 tokens do not fit (data/bins.py says so)."""
    cfg, facts = tiny
    c = next(c for c in enumerate_candidates(["vision", "audio", "language"], 4, [64], 0)
             if c.layouts["language"].dp == 4 and c.microbatches == 1)
    with pytest.raises(ValueError, match="more than its bins hold"):
        validate(CONFIG, [], c, facts)


def test_memory_filter(tiny):
    """A layout must fit (1 − headroom) of --gpu-memory: the cost model under-predicts peaks by up to 19%."""
    cfg, facts = tiny
    free = search(CONFIG, [], cfg, facts, 4, cpu_calibration(), top=10)
    lowest = min(r.estimate.memory_bytes for r in free.ranked)
    fits = (lowest + 1) / GIB  # only layouts at the lowest memory of the unlimited top 10, or lower
    limit = fits / (1 - MEMORY_HEADROOM)
    capped = search(CONFIG, [], cfg, facts, 4, cpu_calibration(), gpu_memory_gib=limit, top=10)
    assert capped.over_memory > 0
    assert capped.ranked and all(r.estimate.memory_bytes <= fits * GIB for r in capped.ranked)
    # the same limit without headroom admits layouts predicted between 80% and 100% of it
    bare = search(CONFIG, [], cfg, facts, 4, cpu_calibration(), gpu_memory_gib=limit, top=10, headroom=0)
    assert any(r.estimate.memory_bytes > fits * GIB for r in bare.ranked)


def test_recomputing_is_searched_where_memory_asks_for_it(tiny):
    """Activation checkpointing is a searched choice: with memory to spare no layout recomputes (a forward more
    costs time, and the search does not price it); under a limit that no layout meets without recomputing, the
    search proposes layouts that recompute, where it would otherwise propose none."""
    cfg, facts = tiny
    free = search(CONFIG, [], cfg, facts, 4, cpu_calibration(), top=50)
    assert {r.candidate.activation_checkpointing for r in free.ranked} == {"none"}
    least = min(free.ranked, key=lambda r: r.estimate.memory_bytes)
    full = replace(least.candidate, activation_checkpointing="full")
    recomputing = estimate_steps(facts.sizes, full.layouts, settings_of(cfg, full), facts.steps, cpu_calibration())
    assert recomputing.memory_bytes < least.estimate.memory_bytes
    limit = (recomputing.memory_bytes + least.estimate.memory_bytes) / 2 / GIB / (1 - MEMORY_HEADROOM)
    capped = search(CONFIG, [], cfg, facts, 4, cpu_calibration(), gpu_memory_gib=limit, top=10)
    assert capped.ranked and all(r.candidate.activation_checkpointing != "none" for r in capped.ranked)
    assert {"none", "selective", "full"} >= {r.candidate.activation_checkpointing for r in capped.ranked}
    compiled = load_config(CONFIG, ["--train.compile=true"])
    assert checkpointing_modes(compiled) == ("none", "full")  # loom refuses selective with compile
    assert checkpointing_modes(cfg) == ("none", "selective", "full")


def test_written_config_loads_with_the_chosen_layout(tiny, tmp_path):
    cfg, facts = tiny
    best = search(CONFIG, ["--train.steps=7"], cfg, facts, 4, cpu_calibration(), top=1).ranked[0].candidate
    # keys differing from default.toml's
    c = replace(best, microbatches=2, tokens_per_microbatch=1024, activation_checkpointing="full")
    path = tmp_path / "chosen.toml"
    path.write_text(chosen_config_text(CONFIG, ["--train.steps=7"], c, cfg))
    loaded = load_config(path)  # its own layout.world_size
    assert loaded.layout.world_size == 4 and loaded.train.steps == 7
    assert (loaded.train.microbatches, loaded.data.tokens_per_microbatch) == (2, 1024)
    assert loaded.train.activation_checkpointing == "full"
    assert loaded.train.global_batch_size == cfg.train.global_batch_size  # the original's keys kept
    topo = Topology.plan(loaded, 4)
    for name, lay in c.layouts.items():
        got = topo.placement.layouts[name]
        assert (got.tp, got.cp, got.pp, got.dp) == (lay.tp, lay.cp, lay.pp, lay.dp)


# ---------------------------------------------------------------- the cost model's terms, by hand

SIZES = ModuleSizes("language", params=1200, expert_params=0, matmul_params=1000, layers=2, hidden=8,
                    attention_width=8, kv_width=4, kv_heads=2, mlp_width=16, mlp_tensors=4, causal=True, vocab=32)


def test_pipeline_bubble():
    assert pipeline_bubble(1, 8) == 0.0
    assert pipeline_bubble(4, 8) == pytest.approx(3 / 11)
    assert pipeline_bubble(2, 1) == pytest.approx(1 / 2)
    assert pipeline_bubble(4, 8, virtual_stages=2) == pytest.approx(3 / 19)


def test_collective_bus_bytes():
    cal = unit_calibration()
    assert collective_s(cal, "all_gather", 1, 1e6) == 0.0
    assert collective_s(cal, "all_gather", 4, 400) == pytest.approx(300)  # (g−1)/g of the buffer
    assert collective_s(cal, "all_reduce", 4, 400) == pytest.approx(600)  # reduce-scatter + all-gather


def test_fsdp_bytes_for_a_known_parameter_count():
    """1,200 parameters over dp4, bf16 gathers twice (resharded after forward), one fp32 reduce-scatter."""
    assert fsdp_bytes(1200, 2, 3, 2) == 400
    s = Settings(dtype_bytes=2, microbatches=1, reshard_after_forward=True)
    c = module_costs(SIZES, ModuleLayout(dp=4), s, 100, [100], 1, unit_calibration())
    assert c.seconds["fsdp"] == pytest.approx(2 * 1200 * 2 * 3 / 4 + 1200 * 4 * 3 / 4)
    kept = module_costs(SIZES, ModuleLayout(dp=4), replace(s, reshard_after_forward=False), 100, [100], 1,
                        unit_calibration())
    assert kept.seconds["fsdp"] == pytest.approx(1200 * 2 * 3 / 4 + 1200 * 4 * 3 / 4)
    assert c.bytes["weights+grads+adamw"] == pytest.approx(16 * 1200 / 4)
    # a latency per FSDP unit: 2 blocks + the root, each gathered twice and reduced once
    slow_links = {k: {4: Link(1.0, 1e30)} for k in ("all_gather", "all_reduce")}
    per_unit = module_costs(SIZES, ModuleLayout(dp=4), s, 100, [100], 1, unit_calibration(collectives=slow_links))
    assert per_unit.seconds["fsdp"] == pytest.approx(3 * 2 + 3)
    # both blocks in one unit (parallel.module_blocks_per_unit): one unit + the root, each a latency
    one_unit = replace(s, unit_blocks={SIZES.name: 2})
    assert module_costs(SIZES, ModuleLayout(dp=4), one_unit, 100, [100], 1,
                        unit_calibration(collectives=slow_links)).seconds["fsdp"] == pytest.approx(2 * 2 + 2)


def test_a_split_layer_pays_its_measured_extra_host_time():
    """calibration.layer_extra_s: per layer and microbatch, tp's and fsdp's extra for the nearest group size at or
    below the module's; none on one rank."""
    cal = unit_calibration(overhead_per_layer_s=0.125, layer_extra_s={"tp": {2: 0.5}, "fsdp": {2: 0.25, 4: 1.0}})
    s = Settings(microbatches=3)

    def host(lay: ModuleLayout) -> float:
        return module_costs(SIZES, lay, s, 400, [100] * 4, 3, cal).seconds["host"]

    assert host(ModuleLayout(dp=1)) == pytest.approx(3 * 2 * 0.125)  # 3 microbatches × 2 layers
    assert host(ModuleLayout(tp=2, dp=2)) == pytest.approx(3 * 2 * (0.125 + 0.5 + 0.25))
    assert host(ModuleLayout(dp=4)) == pytest.approx(3 * 2 * (0.125 + 1.0))
    assert host(ModuleLayout(dp=8)) == pytest.approx(3 * 2 * (0.125 + 1.0))  # 8 not measured: 4's figure
    assert host(ModuleLayout(tp=4, dp=2)) == pytest.approx(3 * 2 * (0.125 + 0.5 + 0.25))  # tp4: tp2's


def test_more_tp_pays_more_tp_bytes():
    cal, s = unit_calibration(), Settings(dtype_bytes=2)
    tp = [module_costs(SIZES, ModuleLayout(tp=t, dp=4 // t), s, 400, [100] * 4, 1, cal).seconds["tp"]
          for t in (1, 2, 4)]
    assert tp[0] == 0 and tp[0] < tp[1] < tp[2]
    # tp2·dp2: each rank's 200 tokens × 8 wide × 2 bytes, 4 all-reduces per layer, 2 layers, bus 2·(1/2)
    assert tp[1] == pytest.approx(2 * 4 * 200 * 8 * 2)


def test_pipeline_stretches_by_its_bubble_and_sends_activations():
    cal = unit_calibration()
    sizes = {"language": SIZES}
    work = Workload((100,) * 8)
    flat = estimate(sizes, {"language": ModuleLayout(dp=2)}, Settings(microbatches=4), work, cal)
    piped = estimate(sizes, {"language": ModuleLayout(pp=2, dp=1)}, Settings(microbatches=4), work, cal)
    assert piped.bubble == pytest.approx(1 / 5)
    assert flat.bubble == 0 and "pp" not in flat.seconds and piped.seconds["pp"] > 0
    # the same tokens per rank (dp2 against pp2) and the same work: the bubble makes the difference in compute
    assert piped.seconds["compute"] == pytest.approx(flat.seconds["compute"] / (1 - 1 / 5))


def test_the_head_is_priced_on_the_targets_except_under_sequence_parallel():
    """The LLM's head (hidden × vocab = 256 of SIZES' 1,000 matmul parameters) projects the step's 100 targets,
    not its 400 tokens, and keeps their logits (bf16, held by the runner) and the eager loss's three fp32 buffers of
    them at its peak (activations.py); under tp with sequence parallel it projects every row."""
    cal, sizes = unit_calibration(), {"language": SIZES}
    every, targets = Workload((100,) * 4), Workload((100,) * 4, llm_targets=100)
    one = {"language": ModuleLayout(dp=1)}
    saved = estimate(sizes, one, Settings(), every, cal).seconds["compute"] - \
        estimate(sizes, one, Settings(), targets, cal).seconds["compute"]
    assert saved == pytest.approx(6 * 8 * 32 * 300)
    logits = [module_costs(SIZES, ModuleLayout(), Settings(), 400, [100] * 4, 1, cal, head).bytes["logits"]
              for head in (None, 100)]
    assert logits == [pytest.approx(14 * 400 * 32), pytest.approx(14 * 100 * 32)]
    tp_sp, sp = {"language": ModuleLayout(tp=2)}, Settings(sequence_parallel=True)
    assert estimate(sizes, tp_sp, sp, targets, cal).seconds == estimate(sizes, tp_sp, sp, every, cal).seconds


def test_a_replicated_module_holds_its_state_whole_and_all_reduces_once():
    """`fsdp = false`: the weights, gradients and AdamW moments of every parameter on each rank (dp4 holds 4× the
    sharded state) and nothing gathered; its collective is one all-reduce of the gradients a step."""
    cal = unit_calibration()
    sharded = module_costs(SIZES, ModuleLayout(dp=4), Settings(), 4096, [1024] * 4, 1, cal)
    whole = module_costs(SIZES, ModuleLayout(dp=4), Settings(replicated=frozenset({SIZES.name})), 4096, [1024] * 4,
                         1, cal)
    assert whole.bytes["weights+grads+adamw"] == pytest.approx(4 * sharded.bytes["weights+grads+adamw"])
    assert whole.bytes["gathered weights"] == 0 < sharded.bytes["gathered weights"]
    assert whole.seconds["fsdp"] == pytest.approx(collective_s(cal, "all_reduce", 4, fsdp_bytes(SIZES.params, 1, 1, 4)))
    assert whole.seconds["optimizer"] == pytest.approx(4 * sharded.seconds["optimizer"])


def test_an_hsdp_module_holds_its_state_over_its_shard_and_all_reduces_the_shards():
    """`shard = 2` at dp4: the state of 2 ranks' shards (2× FSDP2's over 4), gathers and reduce-scatters over 2
    ranks, and one all-reduce of each rank's gradient shard across the 2 replicas a step."""
    cal = unit_calibration()
    flat = module_costs(SIZES, ModuleLayout(dp=4), Settings(), 4096, [1024] * 4, 1, cal)
    hsdp = module_costs(SIZES, ModuleLayout(dp=4), Settings(shard={SIZES.name: 2}), 4096, [1024] * 4, 1, cal)
    assert hsdp.bytes["weights+grads+adamw"] == pytest.approx(2 * flat.bytes["weights+grads+adamw"])
    gathers = module_costs(SIZES, ModuleLayout(dp=2), Settings(), 2048, [1024] * 2, 1, cal).seconds["fsdp"]
    across = collective_s(cal, "all_reduce", 2, fsdp_bytes(SIZES.params, 1, 1, 4) / 2)
    assert hsdp.seconds["fsdp"] == pytest.approx(gathers + across)


def test_activation_checkpointing_keeps_less():
    full = activation_bytes_per_token_layer(SIZES, 1, 2, checkpointing="full")
    none = activation_bytes_per_token_layer(SIZES, 1, 2)
    assert full == 8 * 2 and none == (4 * 8 + 2 * 8 + 2 * 4 + 4 * 16) * 2


def test_noncolocated_runs_encoders_beside_the_llm():
    """Encoders on ranks of their own: max(E, L) + min(E, L)/M, not E + L."""
    cal = unit_calibration()
    enc = replace(SIZES, name="vision", vocab=0, causal=False, out_width=8)
    sizes, work = {"vision": enc, "language": SIZES}, Workload((100,) * 4, {"vision": (50,) * 4})
    s = Settings(microbatches=2)
    apart = estimate(sizes, {"vision": ModuleLayout(dp=1), "language": ModuleLayout(dp=1, start=1)}, s, work, cal)
    e = module_costs(enc, ModuleLayout(dp=1), s, 200, [50] * 4, 2, cal).total_s(cal)
    llm = module_costs(SIZES, ModuleLayout(dp=1), s, 400, [100] * 4, 2, cal).total_s(cal)
    e, llm = e + apart.seconds["bridge"], llm + apart.seconds["bridge"]  # both sides move the rows
    assert apart.step_s == pytest.approx(max(e, llm) + min(e, llm) / 2)
    assert apart.step_s < e + llm


# ---------------------------------------------------------------- calibration file and the CLI


def test_calibration_round_trip_and_errors(tmp_path):
    cal = cpu_calibration()
    path = save_calibration(cal, tmp_path / "cal.json")
    assert load_calibration(path) == replace(cal, source="")
    split = replace(cal, layer_extra_s={"tp": {2: 0.03, 4: 0.08}, "fsdp": {2: 0.01}})
    assert load_calibration(save_calibration(split, tmp_path / "split.json")).layer_extra_s == split.layer_extra_s
    assert load_calibration(None).matmul_flops_per_s == 800e12  # H200 defaults without a file
    data = json.loads(path.read_text())
    del data["collectives"]["all_reduce"]
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="collectives.all_reduce is missing"):
        load_calibration(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match="does not exist"):
        load_calibration(tmp_path / "none.json")


def test_cli_search_end_to_end(tmp_path, capsys):
    cal = save_calibration(cpu_calibration(), tmp_path / "cal.json")
    out = tmp_path / "best.toml"
    code = main(["plan", str(DEFAULT_CONFIG), "--search", "--gpus", "4", "--calibration", str(cal),
                 "--top", "3", "--out", str(out), "--train.global_batch_size=16"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "the 3 fastest layouts on 4 GPUs" in printed and f"written to {out}" in printed
    loaded = load_config(out)
    assert loaded.train.global_batch_size == 16 and loaded.layout.world_size == 4


def test_cli_search_needs_gpus(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--search"])
    assert "--search needs --gpus N" in capsys.readouterr().err


def test_spearman_of_known_rankings():
    from bench.plan_validate import spearman

    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # one swap among four: 1 − 6·Σd²/(n(n²−1)) = 1 − 6·2/60
    assert spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
    # a tie takes the average rank: ranks (1.5, 1.5, 3) against (1, 2, 3) → Pearson of those ranks
    assert spearman([5, 5, 9], [1, 2, 3]) == pytest.approx(1.5 / (1.5 * 2) ** 0.5)  # cov 1.5, variances 1.5, 2


def test_the_calibration_summary_names_only_what_was_measured():
    from loom.plan_search.calibrate import summary

    one_gpu = Calibration("one rank", 7.6e14, 2.9e12, 2.4e-3, 1e-3, True, GIB)
    assert "per layer split" not in summary(one_gpu) and summary(one_gpu).startswith("760,000.0 GFLOP/s")
    four = replace(cpu_calibration(), layer_extra_s={"tp": {2: 0.028}})
    assert summary(four).endswith("per layer split tp g2 +28.0 ms")
