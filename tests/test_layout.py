"""Layouts and placement: valid configs resolve to the expected degrees; invalid ones fail with a message
that names the module, the dimension and the numbers."""

from __future__ import annotations

import pytest

from loom.config import ConfigError
from loom.job import load_config
from loom.topology import Topology
from loom.topology.layout import parse_ranks


def plan(world: int, *overrides: str) -> Topology:
    return Topology.plan(load_config(None, list(overrides)), world)


def degrees(topo: Topology, module: str) -> tuple[int, int, int, int, range]:
    lay = topo.placement.layouts[module]
    return lay.tp, lay.cp, lay.pp, lay.dp, lay.ranks


def test_default_is_data_parallel_everywhere():
    topo = plan(4)
    assert topo.placement.kind == "colocated"
    for module in ("vision", "audio", "language"):
        assert degrees(topo, module) == (1, 1, 1, 4, range(4))


def test_unlisted_encoder_follows_language_ranks():
    topo = plan(8, "--layout.language.tp=2", '--layout.vision.ranks="0-7"', "--layout.vision.tp=2")
    assert degrees(topo, "audio") == (1, 1, 1, 8, range(0, 8))  # not listed: the LLM's ranks, dp only
    assert topo.placement.kind == "colocated"
    # so with the vision encoder on ranks of its own, the unlisted audio encoder would sit on the LLM's: refused
    with pytest.raises(ConfigError, match="audio share the language model's ranks 4-7"):
        plan(8, '--layout.language.ranks="4-7"', '--layout.vision.ranks="0-3"')


def test_heterogeneous_colocated():
    topo = plan(8, "--layout.vision.tp=1", "--layout.audio.tp=2", "--layout.language.tp=2", "--layout.language.cp=2",
                "--data.pad_to_multiple=8")
    assert degrees(topo, "vision") == (1, 1, 1, 8, range(8))
    assert degrees(topo, "audio") == (2, 1, 1, 4, range(8))
    assert degrees(topo, "language") == (2, 2, 1, 2, range(8))
    assert topo.placement.colocated


def test_explicit_dp_that_fits():
    topo = plan(8, "--layout.language.tp=2", "--layout.language.dp=4")
    assert degrees(topo, "language")[3] == 4


def test_parse_ranks():
    assert parse_ranks("0-3", 8, "k") == range(0, 4)
    assert parse_ranks("5", 8, "k") == range(5, 6)
    assert parse_ranks("", 8, "k") == range(8)
    assert parse_ranks(5, 8, "k") == range(5, 6)  # TOML `ranks = 5`: one rank


def test_a_module_on_one_rank_written_as_a_toml_integer(tmp_path):
    """`ranks = 0` (a TOML integer, rank 0 included: not read as "unset") puts the encoders on rank 0 alone."""
    toml = tmp_path / "job.toml"
    toml.write_text("[layout.vision]\nranks = 0\n[layout.audio]\nranks = 0\n[layout.language]\nranks = \"1-2\"\n")
    topo = Topology.plan(load_config(toml), 3)
    assert topo.placement.kind == "non-colocated"
    assert degrees(topo, "vision") == (1, 1, 1, 1, range(0, 1)) and degrees(topo, "language")[4] == range(1, 3)


INVALID = [
    # (world, overrides, fragments every message must contain)
    (8, ["--layout.language.tp=3"], ["language", "tp·cp·pp", "3", "8 ranks"]),
    (8, ["--layout.language.tp=2", "--layout.language.dp=3"], ["language", "tp·cp·pp·dp", "6", "8 ranks", "dp = 4"]),
    (8, ["--layout.language.tp=0"], ["layout.language.tp", "0", "≥ 1"]),
    (8, ["--layout.vision.dp=-1"], ["layout.vision.dp", "-1"]),
    (8, ['--layout.language.ranks="a-b"'], ["layout.language.ranks", "'a-b'", "first-last"]),
    (8, ['--layout.language.ranks="5-2"'], ["layout.language.ranks", "ascending"]),
    (8, ['--layout.language.ranks="0-9"'], ["layout.language.ranks", "rank 9", "8 ranks"]),
    (8, ['--layout.vision.ranks="0-5"', '--layout.language.ranks="4-7"'],
     ["vision (ranks 0-5)", "(ranks 4-7)", "partially overlap", "[4, 5]"]),
    (8, ['--layout.vision.ranks="0-1"', '--layout.audio.ranks="0-1"', '--layout.language.ranks="4-7"'],
     ["ranks [2, 3]", "tile"]),
    (8, ['--layout.language.ranks="0-3"'], ["ranks [4, 5, 6, 7]", "idle"]),
    (4, ['--layout.vision.ranks="0-1"', '--layout.audio.ranks="0-1"', '--layout.language.ranks="2-3"',
         "--layout.language.pp=2", "--parallel.pp_schedule=interleaved_1f1b", "--parallel.pp_virtual_stages=2",
         "--data.tokens_per_microbatch=512", "--train.microbatches=2"],
     ["parallel.pp_schedule = 'interleaved_1f1b'", "ranks of their own", "'1f1b' and 'gpipe'"]),
    (5, ['--layout.vision.ranks="0-2"', '--layout.audio.ranks="0-2"', '--layout.language.ranks="3-4"',
         "--train.global_batch_size=12"], ["vision: dp = 3 and language dp = 2", "one must divide the other"]),
    (8, ['--layout.vision.ranks="0-3"', '--layout.audio.ranks="4-7"', '--layout.language.ranks="0-3"'],
     ["vision share the language model's ranks 0-3", "layout.vision.ranks"]),
    (8, ["--layout.language.tp=8", "--model.language.num_kv_heads=4"],
     ["language", "tp = 8", "model.language.num_heads = 4", "tp ∈ {1, 2, 4}"]),
    (6, ["--layout.language.tp=6", "--model.language.num_heads=12", "--model.language.num_kv_heads=4",
         "--model.language.head_dim=16", "--model.language.vocab_size=384", "--model.language.intermediate_size=384"],
     ["language", "tp = 6", "neither divides model.language.num_kv_heads = 4 nor is a multiple", "tp ∈ {1, 2}"]),
    (4, ["--layout.language.tp=2", "--model.language.vocab_size=321"], ["language", "vocab_size = 321", "tp ∈ {1}"]),
    (8, ["--layout.language.pp=8"], ["language", "pp = 8", "8 stages", "num_layers = 4"]),
    (4, ["--layout.vision.cp=2"], ["vision", "cp = 2", "encoders do not use context parallelism"]),
    (8, ["--layout.audio.tp=8"], ["audio", "tp = 8", "model.audio", "tp ∈ {1, 2, 4}"]),
    (4, ["--layout.vision.pp=4"], ["vision", "pp = 4", "unpipelined"]),
    (4, ["--layout.language.cp=2", "--data.tokens_per_microbatch=90"],
     ["data.tokens_per_microbatch = 90", "multiple of 4", "2·cp = 4 chunks", "use 88 or 92"]),
    (4, ["--layout.language.tp=2", "--layout.language.sequence_parallel=true", "--data.tokens_per_microbatch=9",
         "--data.pad_to_multiple=3"],
     ["not a multiple of 6", "data.pad_to_multiple = 3 and tp = 2 sequence-parallel shards", "use 6 or 12"]),
    (2, ["--train.microbatches=3"], ["train.global_batch_size = 32", "train.microbatches = 3"]),
    # CUDA graphs do not survive FSDP2's gathers: refused at load, not a 13× slower run
    (4, ["--train.compile=true", "--train.compile_mode=reduce-overhead", "--data.tokens_per_microbatch=256",
         "--layout.vision.tp=4", "--layout.audio.tp=4", "--layout.language.tp=2"],
     ["train.compile_mode = 'reduce-overhead'", "language sharded by FSDP2 over dp·cp = 2 ranks",
      "train.compile_mode = 'default'"]),
    (2, ["--parallel.module_blocks_per_unit.video=2"], ["parallel.module_blocks_per_unit.video = 2",
                                                        "['audio', 'language', 'vision']"]),
    (2, ["--parallel.module_blocks_per_unit.vision=0"], ["parallel.module_blocks_per_unit.vision = 0"]),
    (2, ["--parallel.fsdp_prefetch=-1"], ["parallel.fsdp_prefetch = -1", "≥ 0"]),
    (2, ["--train.microbatches=4", "--train.global_batch_size=12"], ["dp = 2 × train.microbatches = 4", "8"]),
    (4, ["--layout.language.sequence_parallel=true"], ["sequence_parallel = true needs tp > 1"]),
    (4, ["--layout.vision.sequence_parallel=true"], ["vision: sequence_parallel = true", "tp > 1 dividing 64",
                                                     "not tp = 1"]),
    (8, ["--train.global_batch_size=12"], ["train.global_batch_size = 12", "dp = 8"]),
    (4, ["--model.encoders=['vision']", "--data.tasks=['digits']", "--layout.audio.tp=1"],
     ["[layout.audio]", "no audio module"]),
    (4, ["--layout.world_size=8"], ["layout.world_size = 8", "4 ranks"]),
    (4, ["--layout.language.sp=2"], ["unknown config key 'layout.language.sp'"]),
    (12, ["--layout.vision.tp=3", "--layout.language.tp=4", "--train.global_batch_size=12",
          "--model.vision.num_heads=3", "--model.vision.hidden_size=96", "--model.vision.intermediate_size=192",
          "--model.language.num_heads=4", "--model.language.num_kv_heads=4"],
     ["vision: dp = 4 and language dp = 3", "one must divide the other"]),
]


@pytest.mark.parametrize("world,overrides,fragments", INVALID, ids=[" ".join(o) for _, o, _ in INVALID])
def test_invalid_layout_is_rejected_with_a_clear_message(world, overrides, fragments):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides, world_size=world)
    for fragment in fragments:
        assert fragment in str(err.value), f"{fragment!r} missing from: {err.value}"


def test_the_sample_multiple_is_derived_from_the_layout():
    from loom.topology.checks import sample_multiple
    from loom.topology.layout import resolve_placement

    for world, overrides, expected in [
        (4, ["--layout.language.cp=2"], 4),  # 2·cp chunks per sample
        (4, ["--layout.language.tp=2", "--layout.language.sequence_parallel=true"], 2),
        (8, ["--layout.language.cp=2", "--layout.language.tp=2", "--layout.language.sequence_parallel=true",
             "--data.pad_to_multiple=3"], 24),  # lcm(3, 2·2·2)
        (4, ["--layout.language.tp=2"], 1),  # tp without SP: samples need no padding
    ]:
        cfg = load_config(None, overrides, world_size=world)
        assert sample_multiple(resolve_placement(cfg, world).layouts["language"], cfg) == expected, overrides


def test_layout_errors_come_before_any_model_is_built(monkeypatch):
    import loom.models.multimodal as mm

    monkeypatch.setattr(mm, "build_model", lambda *a, **k: pytest.fail("model built before validation"))
    from loom.cli import main

    assert main(["plan", "configs/tiny.toml", "--world-size=8", "--layout.language.tp=3"]) == 2
