"""The cost model's terms of issue 51's revision, by hand: attention at its own rate as FlashAttention executes it,
each run's slowest replica as loom places the samples, TP's collectives as DTensor issues them, FSDP's host time per
unit, a rank's host and device in the step's order, the drawn steps' mean; the calibration's layer facts, and the
layer probe on CPU."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from loom.plan_search.calibration import H200_DEFAULTS, LayerFacts, load_calibration, save_calibration
from loom.plan_search.cost import ModuleLayout, Settings, Workload, module_costs, tp_collectives
from loom.plan_search.estimate import estimate, estimate_steps, sequenced_s
from loom.plan_search.replicas import per_sample
from loom.typed_config import ConfigError
from tests.test_plan_search import SIZES, cpu_calibration, unit_calibration

ENC = replace(SIZES, name="vision", vocab=0, causal=False, out_width=8, kv_width=8, kv_heads=2)


def test_attention_is_priced_as_flash_attention_runs_it_at_its_own_rate():
    """Forward 2·L²·d per layer causal (4· bidirectional), the backward 2.5× it (the scores recomputed), at the
    layer kind's measured rate; not measured: the matmul rate."""
    cal = unit_calibration(layers={"decoder": LayerFacts(attention_flops_per_s=0.5)})
    c = module_costs(SIZES, ModuleLayout(), Settings(), 100, [100], 1, cal)
    assert c.seconds["attention"] == pytest.approx(2 * 100**2 * 8 * 2 * 3.5 / 0.5)
    enc = module_costs(ENC, ModuleLayout(), Settings(), 100, [100], 1, cal)  # no encoder rate: the matmul rate (1)
    assert enc.seconds["attention"] == pytest.approx(4 * 100**2 * 8 * 2 * 3.5)
    full = module_costs(SIZES, ModuleLayout(), Settings(activation_checkpointing="full"), 100, [100], 1, cal)
    assert full.seconds["attention"] == pytest.approx(c.seconds["attention"] * 4.5 / 3.5)  # one forward more


def test_each_run_takes_its_slowest_replica():
    """dp2 over one step of a 300- and a 100-token sample (equal contiguous shares): the 300-token replica's
    matmuls (3× the mean's… 1.5×) and attention (9² against 1²: 1.8× the mean), as loom places them."""
    cal, s = unit_calibration(), Settings()
    placed = Workload((300, 100))
    spread = replace(placed, llm_lengths=(200, 200))  # the same tokens, evenly: the old price
    lay = {"language": ModuleLayout(dp=2)}
    slow, even = estimate({"language": SIZES}, lay, s, placed, cal), estimate({"language": SIZES}, lay, s, spread, cal)
    matmuls = 6 * (SIZES.matmul_params - 8 * 32)  # the head is priced on the mean
    assert slow.seconds["compute"] - even.seconds["compute"] == pytest.approx(matmuls * (300 - 200))
    assert slow.seconds["attention"] == pytest.approx(2 * 300**2 * 8 * 2 * 3.5)
    # a token budget: each replica computes T tokens whatever its samples (the filler too); attention its own
    budget = estimate({"language": SIZES}, lay, replace(s, tokens_per_microbatch=400), placed, cal)
    assert budget.seconds["attention"] == pytest.approx(slow.seconds["attention"])


def test_an_encoders_replicas_take_their_samples_items():
    """Encoder dp2 beside the LLM's dp2: the replica of the sample with the big item pays for it; without the
    items' samples (item_counts) they are spread evenly."""
    cal, s = unit_calibration(), Settings()
    sizes, lay = {"vision": ENC, "language": SIZES}, {"vision": ModuleLayout(dp=2), "language": ModuleLayout(dp=2)}
    placed = Workload((100, 100), {"vision": (90, 10)}, item_counts={"vision": (1, 1)})
    loose = replace(placed, item_counts={})
    e_placed = estimate(sizes, lay, s, placed, cal).seconds["attention"]
    e_loose = estimate(sizes, lay, s, loose, cal).seconds["attention"]
    llm = 2 * 100**2 * 8 * 2 * 3.5
    assert e_placed - llm == pytest.approx(4 * 90**2 * 8 * 2 * 3.5)
    assert e_loose - llm == pytest.approx(4 * (90**2 + 10**2) / 2 * 8 * 2 * 3.5)
    with pytest.raises(ValueError, match="3 encoder items"):
        per_sample((1, 2, 3), (1, 1))


def test_tp_all_reduces_each_column_parallel_input_gradient():
    """Without sequence parallel: 2 row-parallel outputs + one input-gradient all-reduce per column-parallel
    projection (the ViT's q, k, v, fc1: 6 a layer; the LLM's q, k, v, gate, up: 7); with it, 4."""
    vit, llm = replace(ENC, column_linears=4), replace(SIZES, column_linears=5)
    assert (tp_collectives(vit, False), tp_collectives(llm, False), tp_collectives(llm, True)) == (6, 7, 4)
    cal, s = unit_calibration(), Settings(dtype_bytes=2)
    tp = module_costs(vit, ModuleLayout(tp=2, dp=2), s, 400, [100] * 4, 1, cal).seconds["tp"]
    assert tp == pytest.approx(2 * 6 * 200 * 8 * 2)  # 2 layers × 6 × (200 tokens × 8 wide × 2 bytes, bus ·1)


def test_fsdp_host_time_is_per_unit():
    """The measured FSDP extra is one unit's hooks: 27 layers in units of 9 pay it 3 times a run, not 27."""
    cal = unit_calibration(overhead_per_layer_s=0.0, layer_extra_s={"fsdp": {4: 1.0}})
    deep = replace(ENC, layers=27)
    s = Settings(unit_blocks={"vision": 9})
    assert module_costs(deep, ModuleLayout(dp=4), s, 400, [100] * 4, 1, cal).seconds["host"] == pytest.approx(3)
    assert module_costs(deep, ModuleLayout(dp=4), Settings(), 400, [100] * 4, 1, cal).seconds["host"] == \
        pytest.approx(27)


def test_the_host_runs_ahead_only_of_what_it_has_queued():
    """Phases in order (host s, device s, layers): a host-bound phase leaves the device waiting, a device-bound
    one lets the host run ahead; the step is neither max(host, device) nor their sum."""
    assert sequenced_s([(10, 1, 10)]) == 10  # host-bound: the host's
    assert sequenced_s([(1, 10, 1)]) == 11  # the device starts once the first layer is queued
    assert sequenced_s([(1, 10, 10)]) == pytest.approx(10.1)
    # the encoders' host-bound forward, then the LLM's device-bound one: the device waited through the first
    assert sequenced_s([(10, 1, 10), (1, 10, 10)]) == pytest.approx(20.1)
    # the other way round the host queues the second phase under the first (max(host, device) would say 11)
    assert sequenced_s([(1, 10, 10), (10, 1, 10)]) == pytest.approx(11.1)
    # a colocated rank in order: the encoder's forward (1 s a layer of host, next to no device work) keeps the
    # device waiting before the LLM's device-bound forward and backward; the host then runs ahead of them
    cal = unit_calibration(overhead_per_layer_s=1.0, matmul_flops_per_s=1e5, memory_bytes_per_s=1e15,
                           host_overlaps_device=True)
    sizes = {"vision": replace(ENC, matmul_params=1, attention_width=1), "language": SIZES}
    work = Workload((100,), {"vision": (5,)}, item_counts={"vision": (1,)})
    one = estimate(sizes, {"vision": ModuleLayout(), "language": ModuleLayout()}, Settings(), work, cal)
    device = sum(v for k, v in one.seconds.items() if k != "host")
    # the encoder's forward (2 layers × ⅓ s), then the LLM's first layer queued (⅓ s) before its device work starts
    assert device > one.seconds["host"] and one.step_s == pytest.approx(device + 2 / 3 + 1 / 3, rel=1e-3)


def test_the_search_prices_the_mean_of_the_drawn_steps():
    cal, lay, s = unit_calibration(), {"language": ModuleLayout(dp=2)}, Settings()
    steps = (Workload((300, 100)), Workload((100, 100)))
    each = [estimate({"language": SIZES}, lay, s, w, cal) for w in steps]
    both = estimate_steps({"language": SIZES}, lay, s, steps, cal)
    assert both.step_s == pytest.approx((each[0].step_s + each[1].step_s) / 2)
    assert both.tokens_per_s == pytest.approx(600 / (2 * both.step_s))
    assert both.memory_bytes == max(e.memory_bytes for e in each)


def test_calibration_layer_facts_round_trip_and_fall_back(tmp_path):
    facts = {"decoder": LayerFacts(2e-3, 0.3, 2.5e14, 1e12), "encoder": LayerFacts(attention_flops_per_s=1e14)}
    cal = replace(cpu_calibration(), layers=facts)
    back = load_calibration(save_calibration(cal, tmp_path / "cal.json"))
    assert back.layers == facts
    assert (back.attention_rate("decoder"), back.elementwise_rate("decoder"), back.layer_host_s("decoder")) == \
        (2.5e14, 1e12, 2e-3)
    # not measured: the matmul rate, a copy's rate, the generic block's host time
    assert (back.elementwise_rate("encoder"), back.layer_host_s("encoder")) == (cal.memory_bytes_per_s, 5e-3)
    old = replace(cpu_calibration(), layers={})
    assert old.attention_rate("decoder") == old.matmul_flops_per_s
    assert H200_DEFAULTS.attention_rate("decoder") == 254e12 < H200_DEFAULTS.matmul_flops_per_s
    data = json.loads((tmp_path / "cal.json").read_text())
    data["layers"]["decoder"]["host_s"] = -1
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=">= 0"):
        load_calibration(tmp_path / "bad.json")


def test_the_layer_probe_times_looms_layers_on_cpu():
    """calibrate's layer probe on CPU: a positive host time with its forward's share, an attention rate, and an
    elementwise rate never above the copy's (1 MB/s here: the counted bytes over what is left of the layer's time
    are far more); when the matmuls as priced leave no time (1 FLOP/s), the elementwise rate is the copy's."""
    from loom.plan_search.layer_probe import time_layer

    cpu = torch.device("cpu")
    for kind in ("decoder", "encoder"):
        f = time_layer(kind, cpu, 1, lambda: None, 1e18, 1e6)
        assert f.host_s > 0 and 0 < f.forward_share <= 1 and f.attention_flops_per_s > 0
        assert f.elementwise_bytes_per_s == 1e6
    assert time_layer("encoder", cpu, 1, lambda: None, 1.0, 5e9).elementwise_bytes_per_s == 5e9


def test_calibrate_writes_the_layer_facts(tmp_path):
    """`python -m loom.plan_search.calibrate` on one CPU rank: the file holds both layers' facts, measured."""
    import os
    import subprocess
    import sys

    from loom.plan_search.calibrate import summary

    out = tmp_path / "cal.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-m", "loom.plan_search.calibrate", "--out", str(out), "--quick"], check=True,
                   env=env, capture_output=True, timeout=300)
    cal = load_calibration(out)
    assert set(cal.layers) == {"decoder", "encoder"}
    for facts in cal.layers.values():
        assert facts.host_s > 0 and facts.attention_flops_per_s > 0 and facts.elementwise_bytes_per_s > 0
    assert "decoder layer: host" in summary(cal) and "encoder layer: host" in summary(cal)
