"""The error of Hugging Face interop, in a file of its own so every mapping file can raise it."""


class HFError(ValueError):
    """A Hugging Face checkpoint that loom cannot load (or a loom module it cannot export) exactly."""
