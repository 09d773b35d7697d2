"""Rollouts: the prompts of an iteration, G completions each from the sampler's copy of the policy, gathered on
every rank.

The copy is a whole model on every rank (generation reads every weight at every token), refreshed after each
update from the weight stream (rl/stream.py, projectors included) — the path an external engine would take.

Which rank samples what is fixed by the data alone: the iteration's prompts are cut into sampling batches of
`rl.prompts_per_sampling_batch` prompts (× G rows), batch c is decoded by rank c mod world with a generator
seeded by (rl seed, iteration, c). A batch's rows and seed do not depend on the layout or on which rank runs it,
so two layouts with the same weights draw the same completions, and a resumed run draws what the first run
would have.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from loom.data.sample import Sample
from loom.models.multimodal import MultimodalModel, build_model
from loom.models.sampler import Completion, Sampler, SamplingParams
from loom.rl.stream import stream_weights


@dataclass
class Prompt:
    sample: Sample  # the prompt's tokens (up to where the answer starts) and its images and clips
    record: dict  # what the reward reads: the built-in tasks' task and answer, or a JSONL line's fields
    where: str  # how messages name it (file:line, or "task T, sample i")


@dataclass
class Rollout:
    prompt: int  # index into the iteration's prompts
    completion: Completion
    reward: float | None = None
    advantage: float = 0.0
    problems: list[str] = field(default_factory=list)


class PolicyCopy:
    """The sampler's whole model on this rank, in the training compute dtype, refreshed from the stream."""

    def __init__(self, cfg, tok, device: torch.device) -> None:
        m = cfg.model
        self.dtype = torch.bfloat16 if cfg.train.dtype == "bf16" else torch.float32
        with torch.device(device):  # real storage and buffers; every weight is overwritten by the first refresh
            self.model = build_model(m.language, m.vision if "vision" in m.encoders else None,
                                     m.audio if "audio" in m.encoders else None, tok.placeholder_ids)
        self.model.to(self.dtype).eval().requires_grad_(False)
        self.cfg = m

    @torch.no_grad()
    def refresh(self, policy: MultimodalModel) -> int:
        """The policy's weights, streamed tensor by tensor into the copy (collective); returns the tensors."""
        own = self.model.state_dict()
        _, tensors = stream_weights(policy, self.cfg, self.dtype, projectors=True)
        n = 0
        for entry, t in tensors:
            own[entry.loom_name].copy_(t)
            n += 1
        return n


def sample_rollouts(sampler: Sampler, prompts: list[Prompt], params: SamplingParams, group_size: int,
                    batch_prompts: int, seed: int, iteration: int) -> list[Rollout]:
    """Every prompt's G completions, in prompt order, on every rank (this rank decodes its sampling batches)."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    device = next(sampler.model.parameters()).device
    mine: list[tuple[int, list[int], list[float]]] = []
    for c, start in enumerate(range(0, len(prompts), batch_prompts)):
        if c % world != rank:
            continue
        indices = [i for i in range(start, min(start + batch_prompts, len(prompts))) for _ in range(group_size)]
        generator = torch.Generator(device).manual_seed(seed * 1_000_003 + iteration * 10_007 + c)
        out = sampler.generate([prompts[i].sample for i in indices], params, generator)
        mine += [(i, done.tokens, done.logprobs) for i, done in zip(indices, out)]
    every = [mine]
    if world > 1:
        every = [None] * world
        dist.all_gather_object(every, mine)
    rows = sorted((r for part in every for r in part), key=lambda r: r[0])  # stable: a group keeps its order
    return [Rollout(i, Completion(tokens, logprobs)) for i, tokens, logprobs in rows]
