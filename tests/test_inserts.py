"""Modality rows written into their placeholders (models/llm.py `embed_with_inserts`): the values masked_scatter
would give, each row's gradient exactly its placeholder's, and an encoder with no rows still in the graph."""

from __future__ import annotations

import torch

from loom.models.llm import embed_with_inserts


def test_rows_replace_their_placeholders_in_order_and_get_exactly_their_gradients():
    torch.manual_seed(0)
    embed = torch.nn.Embedding(20, 8)
    ids = torch.tensor([1, 5, 5, 2, 5, 3, 7, 7])
    image, clip = torch.randn(3, 8, requires_grad=True), torch.randn(2, 8, requires_grad=True)
    none = torch.randn(0, 8, requires_grad=True)
    h = embed_with_inserts(embed, ids, {5: image, 7: clip, 9: none})
    expected = embed(ids).detach().clone()
    expected[ids == 5], expected[ids == 7] = image.detach(), clip.detach()
    assert torch.equal(h, expected)
    g = torch.randn_like(h)
    h.backward(g)
    assert torch.equal(image.grad, g[ids == 5]) and torch.equal(clip.grad, g[ids == 7])
    assert none.grad is not None and none.grad.shape == (0, 8)  # the idle encoder's (zero) gradient path
