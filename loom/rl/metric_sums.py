"""MetricSums lives in loom/train/metric_sums.py (issue 52, with the objectives that keep them); this import
path still works."""

from loom.train.metric_sums import MetricSums  # noqa: F401
