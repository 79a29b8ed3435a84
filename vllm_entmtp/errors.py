"""Errors raised by vllm_entmtp. Each names the offending input and what would be accepted."""


class EntMTPError(ValueError):
    """Base class of every error vllm_entmtp raises for bad input (config, checkpoints, tree files)."""


class HeadsCheckpointError(EntMTPError):
    """An MTP heads checkpoint is unreadable, mis-keyed, or does not fit the target model."""


class TreeSetError(EntMTPError):
    """A tree-set JSON file or an inline tree is malformed."""
