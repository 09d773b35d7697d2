"""GRPO's objective lives in loom/train/grpo.py (issue 52: the step's objectives sit beside SFT, in the layer
that runs them); this import path still works."""

from loom.train.grpo import GRPO, METRICS, SAMPLER, SEQUENCE_WEIGHT, sequence_weights  # noqa: F401
from loom.train.token_fields import ADVANTAGE, BEHAVIOUR, REFERENCE  # noqa: F401
