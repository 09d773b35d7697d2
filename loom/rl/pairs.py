"""DPO on the policy's own samples (`loom rl` with train.objective = "dpo").

Each prompt's group of G completions gives at most one pair: its best-rewarded completion (chosen) against its
worst (rejected), when their rewards differ — under exact match, a correct answer against an incorrect one. A
group whose rewards are all equal gives none (counted, as GRPO counts it).

Held-out pairs are made once, the same way, from the *reference* policy's completions of the held-out prompts:
the reference is frozen, so a resumed run makes the same pairs, and their reference logprobs are scored once.
Each evaluation scores them under the policy: an answer's implicit reward is β·(lp − lp_ref) (per token under
train.dpo.length_normalise), and `pairs/accuracy` is the fraction of pairs whose chosen answer's is the larger
(0 on the reference itself, whose margins are all 0).
"""

from __future__ import annotations

from loom.data.sample import Sample
from loom.rl.rollouts import Prompt, Rollout


def completion_sample(prompt: Sample, ro: Rollout, fields: dict[str, list[float]] | None = None) -> Sample:
    """The prompt and its completion as one training sequence: the completion its targets."""
    n = len(ro.completion.tokens)
    return Sample(prompt.tokens + ro.completion.tokens, [False] * len(prompt) + [True] * n, prompt.images,
                  prompt.audio, prompt.task, prompt.where, fields or {})


def preference_pairs(prompts: list[Prompt], rollouts: list[Rollout]) -> tuple[list[list[Sample]], int]:
    """Per prompt whose completions' rewards differ, [chosen, rejected] as samples; and how many groups gave
    no pair (all rewards equal, or none)."""
    pairs, equal = [], 0
    for p, prompt in enumerate(prompts):
        group = [ro for ro in rollouts if ro.prompt == p and ro.reward is not None]
        if not group or max(ro.reward for ro in group) == min(ro.reward for ro in group):
            equal += 1
            continue
        best = max(group, key=lambda ro: ro.reward)  # the first of equals: a seeded draw decides, not the order
        worst = min(group, key=lambda ro: ro.reward)
        pairs.append([completion_sample(prompt.sample, best), completion_sample(prompt.sample, worst)])
    return pairs, equal


def answer_gains(policy: list[list[float]], reference: list[float], length_normalise: bool) -> list[float]:
    """Each answer's lp − lp_ref from its targets' logprobs (policy) and its reference sum."""
    return [(sum(lp) - ref) / (len(lp) if length_normalise else 1) for lp, ref in zip(policy, reference)]


def pair_accuracy(gains: list[float], beta: float) -> dict[str, float]:
    """Held-out pairs' implicit-reward accuracy and mean margin; `gains` alternate chosen, rejected."""
    margins = [beta * (c - r) for c, r in zip(gains[0::2], gains[1::2])]
    if not margins:
        return {}
    return {"pairs/accuracy": sum(m > 0 for m in margins) / len(margins),
            "pairs/margin": sum(margins) / len(margins), "pairs/count": float(len(margins))}
