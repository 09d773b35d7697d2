"""Moved to loom/models/sampler.py (issue 52: held-out evaluation in train/ generates with it too, and train/
sits below rl/); the names stay importable here for code and tests that read them from rl/."""

from loom.models.sampler import Completion, Sampler, SamplingParams, pick

__all__ = ["Completion", "Sampler", "SamplingParams", "pick"]
