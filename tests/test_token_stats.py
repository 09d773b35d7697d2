"""Per-token logprobs, entropy and top-k (loom/rl/token_stats.py): on one process against torch's own
log-softmax, and vocab-parallel on tp ranks against the whole vocabulary — values, ties and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from loom.data.batch import IGNORE_INDEX
from loom.rl.token_stats import chunked_token_stats, token_stats, top_k

V, T = 24, 10


def _logits_and_labels(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, T, V, generator=g) * 3
    logits[0, 1, [3, 9, 17, 20]] = 50.0  # a four-way tie at the top, across vocabulary shards (tp 2, 4)
    labels = torch.randint(0, V, (2, T), generator=g)
    labels[:, -1] = IGNORE_INDEX
    labels[1, :3] = IGNORE_INDEX
    return logits, labels


def _reference(logits: torch.Tensor, labels: torch.Tensor, temperature: float):
    logp = F.log_softmax(logits / temperature, -1)
    picked = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1) * (labels != IGNORE_INDEX)
    return picked, -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_and_entropy_equal_torch_log_softmax(temperature):
    logits, labels = _logits_and_labels()
    stats = token_stats(logits, labels, temperature)
    picked, entropy = _reference(logits, labels, temperature)
    torch.testing.assert_close(stats.logprobs, picked, rtol=0, atol=1e-5)
    torch.testing.assert_close(stats.entropy, entropy, rtol=0, atol=1e-5)


def test_chunks_recomputed_in_backward_equal_the_whole():
    logits, labels = _logits_and_labels()
    a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    whole, chunked = token_stats(a, labels, 0.7), chunked_token_stats(b, labels, 0.7, chunk=3)
    torch.testing.assert_close(chunked.logprobs, whole.logprobs, rtol=0, atol=1e-6)
    torch.testing.assert_close(chunked.entropy, whole.entropy, rtol=0, atol=1e-6)
    (whole.logprobs.sum() + whole.entropy.sum()).backward()
    (chunked.logprobs.sum() + chunked.entropy.sum()).backward()
    torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=1e-6)


def test_top_k_breaks_ties_by_the_lowest_id():
    logits, _ = _logits_and_labels()
    values, ids = top_k(logits, 3)
    assert ids[0, 1].tolist() == [3, 9, 17]  # four tied at 50: the three lowest ids, in order
    order = torch.argsort(-logits, dim=-1, stable=True)[..., :3]
    assert torch.equal(ids, order) and torch.equal(values, logits.gather(-1, order))


def _vocab_parallel(seed: int, k: int, temperature: float) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    logits, labels = _logits_and_labels(seed)
    weights = torch.randn(2, T, generator=torch.Generator().manual_seed(seed + 1))
    whole = logits.clone().requires_grad_()
    stats = token_stats(whole, labels, temperature)
    ((stats.logprobs * weights).sum() + stats.entropy.sum()).backward()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    sharded = distribute_tensor(logits.clone(), mesh, [Shard(-1)]).requires_grad_()
    mine = token_stats(sharded, labels, temperature)
    ((mine.logprobs * weights).sum() + mine.entropy.sum()).backward()
    chunked_logits = distribute_tensor(logits.clone(), mesh, [Shard(-1)]).requires_grad_()
    chunked = chunked_token_stats(chunked_logits, labels, temperature, chunk=3)  # recomputed chunk by chunk
    ((chunked.logprobs * weights).sum() + chunked.entropy.sum()).backward()
    values, ids = top_k(sharded, k, temperature)
    whole_values, whole_ids = top_k(logits, k, temperature)
    return {
        "logprobs": (mine.logprobs - stats.logprobs).abs().max().item(),
        "entropy": (mine.entropy - stats.entropy).abs().max().item(),
        "grad": (sharded.grad.full_tensor() - whole.grad).abs().max().item(),
        "grad_scale": whole.grad.abs().max().item(),
        "chunked": max((chunked.logprobs - stats.logprobs).abs().max().item(),
                       (chunked_logits.grad.full_tensor() - whole.grad).abs().max().item()),
        "top_k_ids_equal": torch.equal(ids, whole_ids),
        "top_k_values": (values - whole_values).abs().max().item(),
    }


@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_equals_the_whole_vocabulary(worlds, world):
    """Each tp rank holds V / tp logits: logprobs, entropy, their gradient and the top-k (a tie spanning
    shards included) equal the whole vocabulary's — the gradient not multiplied by tp."""
    for rank, r in enumerate(worlds.run(world, _vocab_parallel, 0, 5, 0.7)):
        assert r["logprobs"] < 1e-5 and r["entropy"] < 1e-5, (rank, r)
        assert r["grad"] < 1e-6 * r["grad_scale"] + 1e-7, (rank, r)
        assert r["chunked"] < 1e-5, (rank, r)
        assert r["top_k_ids_equal"] and r["top_k_values"] == 0, (rank, r)
