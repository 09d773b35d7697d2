"""Moved to loom/train/token_stats.py (issue 52: the step's reference policy scores with it, and train/ sits
below rl/); the names stay importable here for code and tests that read them from rl/."""

from loom.train.token_stats import (
    TokenStats,
    VocabShard,
    chunked_token_stats,
    sum_over_shards,
    token_stats,
    top_k,
    vocab_shard,
)

__all__ = ["TokenStats", "VocabShard", "chunked_token_stats", "sum_over_shards", "token_stats", "top_k", "vocab_shard"]
