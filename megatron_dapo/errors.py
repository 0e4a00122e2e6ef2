"""Errors shared across layers (a leaf module: it imports nothing of the package)."""


class CheckpointError(RuntimeError):
    """A run checkpoint (or its rollout state) is missing, incomplete or does not fit this run; the
    message names the file."""
