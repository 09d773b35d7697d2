"""DPO's objective lives in loom/train/dpo.py (issue 52: the step's objectives sit beside SFT, in the layer
that runs them); this import path still works (patch loom.train.dpo, where the objective reads its names)."""

from loom.train.dpo import DPO, METRICS, SEQUENCE  # noqa: F401
