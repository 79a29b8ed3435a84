"""Entry point of the ``vllm.general_plugins`` group (``entmtp = vllm_entmtp.plugin:register``).

vLLM calls :func:`register` once in every process it starts (API server, engine core, workers). It is
idempotent; all reaching into vLLM happens in :mod:`vllm_entmtp.patches`.
"""
from __future__ import annotations


def register() -> None:
    """Apply the patches that add the ``entmtp`` speculative method to vLLM.

    Raises:
        RuntimeError: the installed vLLM is not the version the patches were written for.
    """
    from vllm_entmtp.metrics import register_collector
    from vllm_entmtp.patches import apply_all

    apply_all()
    register_collector()  # per-tree counters in /metrics (vllm_entmtp.metrics)
