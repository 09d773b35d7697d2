"""Reinforcement learning on loom's step: per-token statistics of the policy (token_stats.py) and the RL
objectives that plug into the step's objective seam (grpo.py)."""
