"""entmtp's per-request options and which sampling options a request may draft under (no vLLM import).

A request passes options in ``SamplingParams.extra_args`` (``vllm_xargs`` in the OpenAI API):

- ``entmtp_num_draft_tokens``: an int >= 0, at most this many draft tokens per step (0: no drafting);
- ``entmtp_tree_id``: ``"none"`` (no drafting) or a tree id of the scheduled tree set, drafted instead of the
  scheduler's choice (ablations run every static tree and the schedule in one engine).

The front end checks them with every request (:mod:`vllm_entmtp.patches.sampling_params`), so a bad value gets
HTTP 400 naming the key and what is allowed, before the request reaches the engine.
"""
from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

PREFIX = "entmtp_"
#: ``extra_args`` key capping one request's draft tokens per step.
REQUEST_DRAFT_TOKENS_KEY = "entmtp_num_draft_tokens"
#: ``extra_args`` key fixing one request's tree to a tree id of the scheduled tree set ("none": no drafting).
REQUEST_TREE_KEY = "entmtp_tree_id"
KEYS = (REQUEST_DRAFT_TOKENS_KEY, REQUEST_TREE_KEY)
NO_TREE = "none"


class RequestOptionError(ValueError):
    """A bad entmtp request option; ``key`` names it, ``value`` is what was given."""

    def __init__(self, key: str, value: Any, message: str):
        super().__init__(message)
        self.key, self.value = key, value


def validate_request_options(extra_args: Mapping[str, Any] | None, tree_ids: Collection[str] | None) -> None:
    """Check a request's ``entmtp_*`` options.

    Args:
        extra_args: the request's ``SamplingParams.extra_args`` (other keys are left alone).
        tree_ids: the scheduled tree set's tree ids, or None when the server schedules no tree set (then
            ``entmtp_tree_id`` may only be ``"none"``).

    Raises:
        RequestOptionError: an unknown ``entmtp_*`` key, or a value outside what the key allows; the message
            names the key, the value and what is allowed.
    """
    for key, value in (extra_args or {}).items():
        if not key.startswith(PREFIX):
            continue
        if key == REQUEST_DRAFT_TOKENS_KEY:
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise RequestOptionError(key, value, f"{key}={value!r}: allowed: an integer >= 0 (draft tokens per "
                                                     "step for this request; 0: no drafting)")
        elif key == REQUEST_TREE_KEY:
            if value == NO_TREE:
                continue
            if tree_ids is None:
                raise RequestOptionError(key, value, f"{key}={value!r}: this server schedules no tree set; allowed: "
                                                     f"{NO_TREE!r}")
            if not isinstance(value, str) or value not in tree_ids:
                shown = ", ".join(sorted(tree_ids)[:12]) + (", ..." if len(tree_ids) > 12 else "")
                raise RequestOptionError(key, value, f"{key}={value!r} is not a tree of the served tree set; "
                                                     f"allowed: {NO_TREE!r} or one of {shown}")
        else:
            raise RequestOptionError(key, value, f"unknown entmtp request option {key!r}; allowed: "
                                                 f"{', '.join(KEYS)}")


def drafts_nothing(sp) -> bool:
    """Requests whose sampling vLLM's rejection sampler does not apply to draft-token rows: ``min_p`` and
    ``logit_bias`` (vLLM 0.32 refuses them under speculative decoding). Under entmtp they draft nothing, so that
    their one row per step goes through vLLM's full sampler, exactly as without speculation."""
    return sp is not None and (bool(sp.logit_bias) or sp.min_p > 0.0)
