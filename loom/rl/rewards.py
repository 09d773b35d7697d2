"""Rewards and advantages for the RL loop.

A reward is a Python callable named in config (`rl.reward = "package.module:function"`), called with the prompt's
record (a dict: the built-in tasks' `task` and `answer`, or a JSONL line's fields) and the completion's text, and
returning a float. The default is exact match: the completion, up to its end of sequence and stripped, equals the
record's answer. A reward that raises or is not a finite number is not trained on: `score_groups` returns why,
naming the record, and the loop reports and counts it.

Advantages per group of G completions of one prompt: (r − mean) / (std + 1e-6) ("group"), or r − mean ("mean",
Dr. GRPO). A group whose rewards are all equal carries no signal under either; it is counted, then skipped or
kept (its advantages are then 0) as `rl.equal_groups` says.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable

from loom.config import ConfigError

Reward = Callable[[dict, str], float]


def exact_match(record: dict, completion: str) -> float:
    return float(completion.strip() == str(record.get("answer", "")).strip())


def load_reward(spec: str) -> Reward:
    """`rl.reward`: "package.module:function", or empty for exact match; found and checked before any weight."""
    if not spec:
        return exact_match
    module, name = spec.split(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"rl.reward = {spec!r}: {e}") from None
    if not callable(fn):
        raise ConfigError(f"rl.reward = {spec!r} is a {type(fn).__name__}, not a function")
    return fn


def reward_of(reward: Reward, record: dict, completion: str, where: str) -> tuple[float | None, str]:
    """(the reward, "") or (None, why) when the function raised or gave no finite number."""
    try:
        value = reward(record, completion)
    except Exception as e:  # a user's function: whatever it raises is reported with the record, not fatal
        return None, f"{where}: the reward function raised {type(e).__name__}: {e}"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None, f"{where}: the reward function returned {value!r}, not a finite number"
    return float(value), ""


def group_advantages(rewards: list[float], kind: str) -> list[float]:
    """Each completion's advantage within its group (rewards of one prompt's G completions)."""
    mean = sum(rewards) / len(rewards)
    if kind == "mean":
        return [r - mean for r in rewards]
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / max(1, len(rewards) - 1))  # unbiased, as GRPO's
    return [(r - mean) / (std + 1e-6) for r in rewards]


def all_equal(rewards: list[float]) -> bool:
    return max(rewards) == min(rewards)
