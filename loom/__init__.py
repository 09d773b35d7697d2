"""loom: multimodal training where every module has its own parallel layout."""

__version__ = "0.1.0"
