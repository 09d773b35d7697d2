"""Single-process unit tests of the pipeline-parallel pieces: the layer split, which stages a pp rank holds,
the first-stage bridge's routing of encoder rows (step_chunks), the stage modules chained by hand against
the unsplit DecoderLM, and the config rejections of a pipelined LLM. No ranks are spawned."""

from __future__ import annotations

import copy
import itertools
import random

import pytest
import numpy as np
import torch
import torch.nn as nn
from conftest import TINY_MODEL_OVERRIDES, tiny_llm_config

from loom.bridge.replica_rows import ReplicaRows
from loom.bridge.routes import step_chunks
from loom.config import ConfigError
from loom.job import load_config
from loom.data.batch import IGNORE_INDEX, Batch
from loom.data.spans import TokenSpans
from loom.models.llm import DecoderLM, LLMConfig
from loom.parallel.pipeline import (
    MicrobatchData,
    balanced_sizes,
    head_flops,
    layer_flops,
    split_language,
    split_layers,
    stages_of_rank,
)
from loom.train.step_parts import Parts, split_encoder_parts
from loom.train.loss import token_loss_sum

# ---------------------------------------------------------------- the split


def _cfg(num_layers: int, vocab: int = 264, hidden: int = 32) -> LLMConfig:
    return LLMConfig(hidden_size=hidden, num_layers=num_layers, num_heads=4, num_kv_heads=2, intermediate_size=64,
                     vocab_size=vocab, tie_embeddings=False)


def test_flops_are_twice_the_matmul_weights_per_token():
    """Independent of the formula: a matmul costs 2 FLOPs per weight per token; count the real weights."""
    cfg = LLMConfig(hidden_size=48, num_layers=1, num_heads=6, num_kv_heads=2, head_dim=12, intermediate_size=80,
                    vocab_size=300, tie_embeddings=False)
    model = DecoderLM(cfg)
    layer_weights = sum(m.weight.numel() for m in model.layers["0"].modules() if isinstance(m, nn.Linear))
    assert layer_flops(cfg) == 2 * layer_weights
    assert head_flops(cfg) == 2 * model.lm_head.weight.numel()


@pytest.mark.parametrize("sizes", [[1, 3], [3, 1], [2, 2], [1, 1, 1, 1], [2, 1, 3, 1, 1]])
def test_split_layers_takes_explicit_sizes(sizes):
    cfg = _cfg(sum(sizes))
    got = split_layers(cfg, len(sizes), sizes)
    start, want = 0, []
    for n in sizes:
        want.append(list(range(start, start + n)))
        start += n
    assert got == want


def _brute_force_best(n: int, stages: int, layer: int, head: int) -> int:
    """The lowest max stage cost over every contiguous split of n layers into `stages` non-empty stages."""
    best = None
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = [0, *cuts, n]
        costs = [(bounds[s + 1] - bounds[s]) * layer for s in range(stages)]
        costs[-1] += head
        best = max(costs) if best is None else min(best, max(costs))
    return best


CASES = [(n, s, vocab) for n, s in [(4, 2), (7, 3), (8, 2), (9, 4), (12, 5), (6, 6)]
         for vocab in (264, 4000, 20000, 70000)]


@pytest.mark.parametrize("n,stages,vocab", CASES)
def test_balanced_split_covers_every_layer_and_is_optimal(n, stages, vocab):
    cfg = _cfg(n, vocab)
    split = split_layers(cfg, stages)
    assert len(split) == stages
    assert [i for st in split for i in st] == list(range(n))  # every layer once, in order
    assert all(len(st) >= 1 for st in split)
    assert all(st == list(range(st[0], st[0] + len(st))) for st in split)  # contiguous
    layer, head = layer_flops(cfg), head_flops(cfg)
    costs = [len(st) * layer for st in split]
    costs[-1] += head
    assert max(costs) == _brute_force_best(n, stages, layer, head), (split, layer, head)


@pytest.mark.parametrize("seed", range(6))
def test_balanced_sizes_with_uneven_costs_is_optimal(seed):
    """The DP itself, on layers of different costs (the uniform case can hide an off-by-one)."""
    rng = random.Random(seed)
    n = rng.randint(3, 9)
    stages = rng.randint(2, min(n, 5))
    costs = [rng.randint(1, 20) for _ in range(n)]
    extra = rng.randint(0, 40)
    sizes = balanced_sizes(costs, stages, last_extra=extra)
    assert len(sizes) == stages and sum(sizes) == n and min(sizes) >= 1

    def worst(bounds):
        c = [sum(costs[bounds[s] : bounds[s + 1]]) for s in range(stages)]
        c[-1] += extra
        return max(c)

    brute = min(worst([0, *cuts, n]) for cuts in itertools.combinations(range(1, n), stages - 1))
    bounds = [sum(sizes[:s]) for s in range(stages + 1)]
    assert worst(bounds) == brute, (costs, extra, sizes)


def test_large_vocab_gives_the_last_stage_fewer_layers():
    cfg = _cfg(8, vocab=60000)
    assert head_flops(cfg) > 2 * layer_flops(cfg)  # the head weighs several layers
    split = split_layers(cfg, 2)
    assert len(split[-1]) < len(split[0])
    split4 = split_layers(_cfg(12, vocab=60000), 4)
    assert len(split4[-1]) < len(split4[0])
    # a tiny head: the plain even split
    assert [len(st) for st in split_layers(_cfg(8, vocab=264), 2)] == [4, 4]


# ---------------------------------------------------------------- stages of a rank


@pytest.mark.parametrize("pp,virtual", [(1, 1), (2, 1), (2, 2), (3, 2), (4, 3)])
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b"])
def test_stages_of_rank_loop_order(pp, virtual, schedule):
    held = [stages_of_rank(r, pp, virtual, schedule) for r in range(pp)]
    assert sorted(s for h in held for s in h) == list(range(pp * virtual))  # every stage exactly once
    for r, h in enumerate(held):
        assert len(h) == virtual
        assert h == sorted(h) and all(s % pp == r for s in h)  # r, r + pp, r + 2pp, …


@pytest.mark.parametrize("pp", [1, 2, 3, 4])
def test_stages_of_rank_v_order_for_zbv(pp):
    held = [stages_of_rank(r, pp, 2, "zbv") for r in range(pp)]
    assert sorted(s for h in held for s in h) == list(range(2 * pp))
    for r, (down, up) in enumerate(held):
        assert down == r  # the first leg of the V goes down the ranks …
        assert up >= pp and (2 * pp - 1) - up == r  # … the second comes back up: the last stage on rank 0


# ---------------------------------------------------------------- step_chunks: encoder rows → LLM replicas


def _random_step(rng: random.Random, llm_dp: int, microbatches: int, per_mb: int, zero_rows: bool, empty: bool):
    """Per microbatch: each LLM replica's sample positions (ascending, disjoint over the step), and every
    sample's row count (some 0 when `zero_rows`, some replicas without samples when `empty`)."""
    step, rows, next_id = [], {}, 0
    for _ in range(microbatches):
        parts = [[] for _ in range(llm_dp)]
        for _ in range(per_mb):
            parts[rng.randrange(llm_dp)].append(next_id)
            rows[next_id] = rng.choice([0, 0, 1, 3, 5]) if zero_rows else rng.randint(1, 5)
            next_id += 1
        if empty:
            parts[rng.randrange(llm_dp)] = []  # this replica gets no sample this microbatch
        step.append(parts)
    return step, [rows[i] for i in range(next_id)]


def _stream(parts_per_mb: list[list[int]], rows: list[int]) -> list[tuple[int, int]]:
    """A replica's rows for the whole step, microbatch after microbatch: one (sample, row index) per row."""
    return [(p, j) for parts in parts_per_mb for p in parts for j in range(rows[p])]


def _check_tiling(intervals: dict[int, list[tuple[int, int]]], lengths: list[int], side: str):
    for replica, total in enumerate(lengths):
        runs = sorted(intervals.get(replica, []))
        at = 0
        for start, n in runs:
            assert n > 0 and start == at, f"{side} replica {replica}: runs {runs} leave a gap or overlap at {at}"
            at += n
        assert at == total, f"{side} replica {replica}: runs {runs} cover {at} of {total} rows"


ROUTINGS = [(4, 2), (1, 4), (2, 4), (2, 2), (4, 1), (3, 1), (1, 1)]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("zero_rows,empty", [(False, False), (True, True)])
@pytest.mark.parametrize("enc_dp,llm_dp", ROUTINGS, ids=[f"enc{e}-llm{d}" for e, d in ROUTINGS])
def test_step_chunks_route_each_row_to_its_sample(enc_dp, llm_dp, zero_rows, empty, seed):
    rng = random.Random(seed * 100 + enc_dp * 10 + llm_dp)
    step, rows = _random_step(rng, llm_dp, microbatches=3, per_mb=rng.randint(3, 9), zero_rows=zero_rows,
                              empty=empty)
    # the real assignment of samples
    enc_step = [split_encoder_parts(Parts.of(parts), np.array(rows), enc_dp).lists() for parts in step]
    counts = [ReplicaRows(encoder=[sum(rows[p] for p in ps) for ps in enc],
                          llm=[sum(rows[p] for p in ps) for ps in llm]) for enc, llm in zip(enc_step, step)]
    enc_rows = [_stream([mb[e] for mb in enc_step], rows) for e in range(enc_dp)]
    llm_rows = [_stream([mb[d] for mb in step], rows) for d in range(llm_dp)]
    # the same samples on both sides (a sanity check of the setup, not of the code under test)
    assert sorted(r for e in enc_rows for r in e) == sorted(r for d in llm_rows for r in d)

    chunks = step_chunks(counts)
    src_runs, dst_runs = {}, {}
    for c in chunks:
        assert 0 <= c.encoder < enc_dp and 0 <= c.llm < llm_dp
        got, want = enc_rows[c.encoder][c.src : c.src + c.n], llm_rows[c.llm][c.dst : c.dst + c.n]
        assert len(got) == len(want) == c.n, f"{c} reaches past a replica's rows"
        assert got == want, f"{c}: encoder rows {got} are not LLM rows {want}"
        src_runs.setdefault(c.encoder, []).append((c.src, c.n))
        dst_runs.setdefault(c.llm, []).append((c.dst, c.n))
    _check_tiling(src_runs, [len(r) for r in enc_rows], "encoder")
    _check_tiling(dst_runs, [len(r) for r in llm_rows], "LLM")


def test_step_chunks_all_empty_step_has_no_chunks():
    counts = [ReplicaRows(encoder=[0, 0, 0, 0], llm=[0, 0]) for _ in range(3)]
    assert step_chunks(counts) == []


# ---------------------------------------------------------------- stage modules chained on one process


def _packed_batch(vocab: int, lengths: list[int], g: torch.Generator):
    ids = torch.randint(0, vocab, (sum(lengths),), generator=g)
    positions = torch.cat([torch.arange(n) for n in lengths])
    labels = torch.randint(0, vocab, (sum(lengths),), generator=g)
    labels[torch.rand(sum(lengths), generator=g) < 0.3] = IGNORE_INDEX  # some unsupervised tokens
    return ids, positions, TokenSpans.from_lengths(lengths), labels


class _NoModalityRows:
    """Stage 0's row source for a text-only batch."""

    def inserts(self, i, selectors):
        return {}

    def backward_done(self, i):
        pass


# (pp, virtual, schedule): the stage chain visits the ranks in loop or V order
SPLITS = [(2, 1, "1f1b"), (2, 2, "interleaved_1f1b"), (2, 2, "zbv"), (4, 1, "gpipe")]


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("pp,virtual,schedule", SPLITS, ids=[f"pp{p}-v{v}-{s}" for p, v, s in SPLITS])
def test_stages_chained_by_hand_equal_the_unsplit_model(pp, virtual, schedule, tied):
    """Tied: the last stage's head is its own copy of the embedding (zbv: on the embedding's rank too), and the
    two copies' gradients add up to the unsplit model's one gradient of the shared weight."""
    cfg = tiny_llm_config()
    cfg.num_layers, cfg.tie_embeddings = 4, tied
    torch.manual_seed(0)
    model = DecoderLM(cfg)
    with torch.no_grad():  # weights far from the tiny init, so a skipped or repeated layer shows clearly
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0, 0.2)
    g = torch.Generator().manual_seed(3)
    ids, positions, layout, labels = _packed_batch(cfg.vocab_size, [5, 3, 9, 1], g)
    n = int((labels != IGNORE_INDEX).sum())
    assert n > 0

    ref_loss = token_loss_sum(model(ids, positions, layout), labels) / n
    ref_loss.backward()
    ref_grads = {name: p.grad.clone() for name, p in model.named_parameters()}

    # each pp rank's PipelinedLM from its own copy of the model, as every rank builds it
    ranks = [split_language(copy.deepcopy(model), r, pp, virtual, schedule, None) for r in range(pp)]
    n_stages = pp * virtual if schedule != "zbv" else 2 * pp
    owner = {}
    for r, lm in enumerate(ranks):
        lm.zero_grad(set_to_none=True)
        lm.table.microbatches = [MicrobatchData(Batch(ids, labels, positions, layout), None)]
        lm.table.rows = _NoModalityRows()
        lm.table.loss = lambda logits, batch: token_loss_sum(logits, batch.labels) / n
        for module, s in zip(lm.stages, lm.indices):
            owner[s] = module
    assert sorted(owner) == list(range(n_stages))
    mb = torch.tensor([0])
    h = ids
    for s in range(n_stages):
        h = owner[s](h, mb)
    assert h.dim() == 0  # the last stage returns the loss
    torch.testing.assert_close(h, ref_loss, rtol=1e-6, atol=1e-7)
    h.backward()

    # every DecoderLM parameter on exactly one rank, under the DecoderLM's name, with the same gradient; the
    # head copy of a tied embedding (the one-process model names the shared weight once, as the embedding)
    twins = {"lm_head.weight": "embed_tokens.weight"} if tied else {}
    ref_names = set(ref_grads)
    seen: dict[str, int] = {}
    for r, lm in enumerate(ranks):
        assert lm.tied_copies == (twins if n_stages - 1 in lm.indices else {})
        for name, p in lm.named_parameters():
            assert twins.get(name, name) in ref_names, f"rank {r}: {name} is no DecoderLM parameter name"
            assert name not in seen, f"{name} on ranks {seen[name]} and {r}"
            seen[name] = r
            assert p.grad is not None, f"rank {r}: {name} got no gradient"
            if name not in twins and name not in twins.values():
                torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-5, atol=1e-7, msg=f"rank {r}: {name}")
    assert set(seen) - set(twins) == ref_names, f"missing: {sorted(ref_names - set(seen))}"
    # the parts sit where the stages put them: embedding with stage 0, head with the last stage
    first_rank = next(r for r, lm in enumerate(ranks) if 0 in lm.indices)
    last_rank = next(r for r, lm in enumerate(ranks) if n_stages - 1 in lm.indices)
    assert seen["embed_tokens.weight"] == first_rank and seen["lm_head.weight"] == last_rank
    if tied:
        embedding, head = ranks[first_rank].embed_tokens.weight, ranks[last_rank].lm_head.weight
        assert head is not embedding and torch.equal(head.detach(), embedding.detach())  # a copy, equal at start
        shared = ref_grads["embed_tokens.weight"]
        assert not torch.allclose(embedding.grad, shared, rtol=1e-3)  # each copy holds only its own part …
        torch.testing.assert_close(embedding.grad + head.grad, shared, rtol=1e-5, atol=1e-7)  # … they add up


def test_pipelined_lm_state_dict_uses_the_decoder_names():
    cfg = tiny_llm_config()
    cfg.num_layers, cfg.tie_embeddings = 4, False
    model = DecoderLM(cfg)
    names = set(model.state_dict())
    lm0 = split_language(copy.deepcopy(model), 0, 2, 1, "1f1b", [3, 1])
    lm1 = split_language(copy.deepcopy(model), 1, 2, 1, "1f1b", [3, 1])
    k0, k1 = set(lm0.state_dict()), set(lm1.state_dict())
    assert k0 | k1 == names and not k0 & k1
    assert {k.split(".")[1] for k in k0 if k.startswith("layers.")} == {"0", "1", "2"}
    assert {k.split(".")[1] for k in k1 if k.startswith("layers.")} == {"3"}


# ---------------------------------------------------------------- config rejections

def _pp_overrides(*extra: str, pp: int = 2, world: int = 2, layers: int = 4, m: int = 2) -> list[str]:
    return [*TINY_MODEL_OVERRIDES, f"--model.language.num_layers={layers}", f"--layout.world_size={world}",
            f"--layout.language.pp={pp}", f"--train.microbatches={m}", "--data.tokens_per_microbatch=512", *extra]


def _rejected(overrides: list[str], world: int, *fragments: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides, world_size=world)
    msg = str(err.value)
    missing = [f for f in fragments if f not in msg]
    assert not missing, f"{missing} not in message: {msg}"


def test_valid_pipelined_configs_load():
    """The baseline the rejections below change one thing of; each of these must pass."""
    load_config(None, _pp_overrides(), world_size=2)
    load_config(None, _pp_overrides("--parallel.pp_split=[1, 3]"), world_size=2)
    load_config(None, _pp_overrides("--parallel.pp_schedule=interleaved_1f1b", "--parallel.pp_virtual_stages=2",
                                    m=4), world_size=2)
    load_config(None, _pp_overrides("--parallel.pp_schedule=zbv", "--parallel.pp_virtual_stages=2"), world_size=2)
    load_config(None, _pp_overrides("--parallel.pp_schedule=gpipe", m=1), world_size=2)
    load_config(None, _pp_overrides(pp=4, world=4, m=4), world_size=4)
    load_config(None, _pp_overrides("--parallel.pp_grad_reduce=microbatch"), world_size=2)
    load_config(None, _pp_overrides("--parallel.pp_schedule=interleaved_1f1b", "--parallel.pp_virtual_stages=2",
                                    "--parallel.pp_grad_reduce=microbatch", m=4), world_size=2)


REJECTED = {
    "split-sum": (_pp_overrides("--parallel.pp_split=[1, 2]"), 2,
                  ["parallel.pp_split = [1, 2]", "num_layers = 4", "adding up to 3"]),
    "split-length": (_pp_overrides("--parallel.pp_split=[1, 1, 2]"), 2,
                     ["parallel.pp_split = [1, 1, 2]", "expected 2 stage sizes", "it has 3"]),
    "split-empty-stage": (_pp_overrides("--parallel.pp_split=[0, 4]"), 2, ["parallel.pp_split = [0, 4]", "≥ 1"]),
    "split-interleaved-length": (_pp_overrides("--parallel.pp_schedule=interleaved_1f1b",
                                               "--parallel.pp_virtual_stages=2", "--parallel.pp_split=[2, 2]", m=4),
                                 2, ["parallel.pp_split = [2, 2]", "expected 4 stage sizes"]),
    "stages-exceed-layers": (_pp_overrides("--parallel.pp_schedule=interleaved_1f1b",
                                           "--parallel.pp_virtual_stages=3", m=4), 2,
                             ["pp = 2", "parallel.pp_virtual_stages = 3", "6 stages", "num_layers = 4"]),
    "1f1b-few-microbatches": (_pp_overrides(pp=4, world=4, m=3), 4,
                              ["parallel.pp_schedule = '1f1b'", "pp = 4", "train.microbatches", "got 3",
                               "train.microbatches = 4"]),
    "interleaved-not-multiple": (_pp_overrides("--parallel.pp_schedule=interleaved_1f1b",
                                               "--parallel.pp_virtual_stages=2", m=3), 2,
                                 ["'interleaved_1f1b'", "pp = 2", "multiple of pp", "got 3",
                                  "train.microbatches = 4"]),
    "interleaved-one-stage": (_pp_overrides("--parallel.pp_schedule=interleaved_1f1b", m=4), 2,
                              ["'interleaved_1f1b'", "parallel.pp_virtual_stages ≥ 2", "got 1"]),
    "zbv-three-stages": (_pp_overrides("--parallel.pp_schedule=zbv", "--parallel.pp_virtual_stages=3", layers=6),
                         2, ["'zbv'", "parallel.pp_virtual_stages = 2", "got 3"]),
    "zbv-one-stage": (_pp_overrides("--parallel.pp_schedule=zbv"), 2,
                      ["'zbv'", "parallel.pp_virtual_stages = 2", "got 1"]),
    "unknown-schedule": (_pp_overrides("--parallel.pp_schedule=pipedream"), 2,
                         ["parallel.pp_schedule", "'pipedream'", "1f1b", "zbv", "interleaved_1f1b"]),
    "thd-without-budget": (_pp_overrides("--data.tokens_per_microbatch=0"), 2,
                           ["pp > 1", "data.tokens_per_microbatch"]),
    "encoder-pp": (_pp_overrides("--layout.vision.pp=2"), 2, ["vision", "pp = 2", "colocated", "unpipelined"]),
    "grad-reduce-unknown": (_pp_overrides("--parallel.pp_grad_reduce=sometimes"), 2,
                            ["parallel.pp_grad_reduce", "'sometimes'", "'step'", "'microbatch'"]),
    "grad-reduce-microbatch-zbv": (_pp_overrides("--parallel.pp_schedule=zbv", "--parallel.pp_virtual_stages=2",
                                                 "--parallel.pp_grad_reduce=microbatch"), 2,
                                   ["parallel.pp_grad_reduce = 'microbatch'", "'zbv'", "pp_grad_reduce = 'step'"]),
    "grad-reduce-microbatch-zero-bubble": (_pp_overrides("--parallel.pp_schedule=zero_bubble",
                                                         "--parallel.pp_virtual_stages=2",
                                                         "--parallel.pp_grad_reduce=microbatch", m=4), 2,
                                           ["parallel.pp_grad_reduce = 'microbatch'", "'zero_bubble'",
                                            "'interleaved_1f1b'"]),
    "grad-reduce-without-pp": (_pp_overrides("--parallel.pp_grad_reduce=microbatch", pp=1, world=1), 1,
                               ["parallel.pp_grad_reduce = 'microbatch'", "pp > 1"]),
    "virtual-without-pp": (_pp_overrides("--parallel.pp_virtual_stages=2", pp=1, world=1), 1,
                           ["parallel.pp_virtual_stages", "pp > 1"]),
    "split-without-pp": (_pp_overrides("--parallel.pp_split=[2, 2]", pp=1, world=1), 1,
                         ["parallel.pp_split", "pp > 1"]),
}


@pytest.mark.parametrize("name", list(REJECTED))
def test_pipeline_config_is_rejected_with_a_clear_message(name):
    overrides, world, fragments = REJECTED[name]
    _rejected(overrides, world, *fragments)
