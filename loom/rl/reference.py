"""Moved to loom/train/reference.py (issue 52: `build_job` builds the reference policy, and train/ sits below
rl/); the name stays importable here for code and tests that read it from rl/."""

from loom.train.reference import ReferencePolicy

__all__ = ["ReferencePolicy"]
