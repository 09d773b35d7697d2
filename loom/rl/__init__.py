"""Reinforcement learning on loom's step: the RL objectives that plug into the step's objective seam (grpo.py,
dpo.py) and the loop around the step (loop.py: sampling, rewards, scoring); the per-token statistics and the
reference policy the step itself uses are train/'s (train/token_stats.py, train/reference.py)."""
