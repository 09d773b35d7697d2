"""The colocated bridge on 4 gloo ranks with hand-made ragged rows and known gradients.

Expected values are built from the rank arithmetic alone (which samples each replica owns, how many rows
each sample has), never from the bridge's own code.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from loom.bridge.colocated import ColocatedBridge
from loom.bridge.replica_rows import ReplicaRows
from loom.job import load_config
from loom.topology import Topology

B = 8  # global batch: 8 samples
ROWS = [3, 0, 5, 1, 2, 4, 1, 6]  # modality rows of each sample: ragged, one sample without any
H = 3


def sample_rows(i: int) -> torch.Tensor:
    """Rows of global sample i: values that name the sample and the row."""
    return torch.stack([torch.full((H,), 100.0 * i + r) for r in range(ROWS[i])]) if ROWS[i] else torch.zeros(0, H)


def rows_of(samples: range) -> torch.Tensor:
    return torch.cat([sample_rows(i) for i in samples])


def _bridge(overrides: list[str]) -> dict:
    cfg = load_config(None, overrides + [f"--train.global_batch_size={B}"], world_size=dist.get_world_size())
    topo = Topology.build(cfg)
    vision, lang = topo.grids["vision"], topo.grids["language"]
    bridge = ColocatedBridge(vision, lang, debug_checks=True)
    me = dist.get_rank()
    e, de = vision.coord(me)["dp"], vision.layout.dp
    d, dl = lang.coord(me)["dp"], lang.layout.dp
    enc_samples = range(e * B // de, (e + 1) * B // de)
    llm_samples = range(d * B // dl, (d + 1) * B // dl)
    x = rows_of(enc_samples).requires_grad_(True)
    share = lambda r, n: sum(ROWS[r * B // n : (r + 1) * B // n])  # noqa: E731 - rows of replica r of n
    out = bridge(x, ReplicaRows([share(r, de) for r in range(de)], [share(r, dl) for r in range(dl)]))
    # a known gradient: the same on every rank of an LLM replica (as the LLM's replicated input grad is)
    grad = -rows_of(llm_samples)
    out.backward(grad)
    return {"mode": bridge.mode, "out": out.detach(), "expected_out": rows_of(llm_samples),
            "grad": x.grad, "expected_grad": -rows_of(enc_samples)}


def test_fan_in_gathers_forward_and_narrows_backward(worlds):
    # vision tp1·dp4 (each rank its own 2 samples) → language tp2·dp2 (each pair of ranks 4 samples)
    results = worlds.run(4, _bridge, ["--layout.vision.tp=1", "--layout.language.tp=2"])
    for r in results:
        assert r["mode"] == "fan-in"
        assert torch.equal(r["out"], r["expected_out"])
        assert torch.equal(r["grad"], r["expected_grad"])


def test_fan_in_from_a_tensor_parallel_encoder(worlds):
    # vision tp2·dp2 (a replica on two ranks, only its first one sends) → language tp4·dp1
    results = worlds.run(4, _bridge, ["--layout.vision.tp=2", "--layout.language.tp=4",
                                      "--model.language.num_heads=4", "--model.language.num_kv_heads=4"])
    for r in results:
        assert r["mode"] == "fan-in"
        assert torch.equal(r["out"], r["expected_out"])
        assert torch.equal(r["grad"], r["expected_grad"])


def test_fan_out_narrows_forward_and_gathers_backward(worlds):
    # vision tp4·dp1 (all 8 samples on every rank) → language tp1·dp4 (2 samples per rank)
    results = worlds.run(4, _bridge, ["--layout.vision.tp=4", "--layout.audio.tp=4"])
    for r in results:
        assert r["mode"] == "fan-out"
        assert torch.equal(r["out"], r["expected_out"])
        assert torch.equal(r["grad"], r["expected_grad"])  # every LLM replica's rows, back in sample order


def test_equal_is_identity(worlds):
    results = worlds.run(4, _bridge, ["--layout.vision.tp=2", "--layout.audio.tp=2", "--layout.language.tp=2"])
    for r in results:
        assert r["mode"] == "equal"
        assert torch.equal(r["out"], r["expected_out"]) and torch.equal(r["grad"], r["expected_grad"])


def _replication_check_catches_divergence() -> str:
    cfg = load_config(None, ["--layout.vision.tp=2", "--layout.language.tp=2", f"--train.global_batch_size={B}"],
                      world_size=dist.get_world_size())
    topo = Topology.build(cfg)
    bridge = ColocatedBridge(topo.grids["vision"], topo.grids["language"], debug_checks=True)
    x = torch.ones(2, H) * (1 + dist.get_rank())  # tp ranks of one replica disagree
    try:
        bridge(x, ReplicaRows([2, 2], [2, 2]))
    except RuntimeError as e:
        return str(e)
    return ""


def test_debug_check_rejects_encoder_output_that_differs_across_tp(worlds):
    for message in worlds.run(4, _replication_check_catches_divergence):
        assert "vision encoder: output differs between its tp ranks" in message
