"""Patch of ``vllm.config.speculative.SpeculativeConfig``: accept and validate ``"method": "entmtp"``.

Runs in every vLLM process (the front end validates first, so bad options fail at start-up, before any engine
process exists). See the table in :mod:`vllm_entmtp.patches`.
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Literal, Union

from vllm_entmtp.config import EntMTPConfigError, parse_entmtp_options, resolve_policy, resolve_static_tree
from vllm_entmtp.errors import HeadsCheckpointError
from vllm_entmtp.heads.formats import read_any_heads_config

# a child of vLLM's "vllm" logger, so that the line reaches `vllm serve`'s log (vllm_entmtp/drafter.py)
logger = logging.getLogger("vllm.entmtp")

METHOD = "entmtp"
#: vLLM's method that entmtp runs under (hidden states handed to the drafter, async scheduling off, V1 runner).
INNER_METHOD = "medusa"


#: SpeculativeConfig fields that vLLM sets itself, not users.
_INTERNAL_KEYS = frozenset({"target_model_config", "target_parallel_config", "draft_model_config",
                            "draft_parallel_config", "draft_load_config"})


def vllm_speculative_keys() -> list[str]:
    """The keys a user may give vLLM's ``SpeculativeConfig`` (``--speculative-config``), sorted: its init fields
    less those vLLM sets itself. Every other key of an entmtp config is entmtp's (:func:`parse_entmtp_options`)."""
    from vllm.config.speculative import SpeculativeConfig

    return sorted(f.name for f in dataclasses.fields(SpeculativeConfig) if f.init and f.name not in _INTERNAL_KEYS)


def _extra_keys(obj) -> list[str]:
    fields = obj.__dataclass_fields__
    return [k for k in vars(obj) if k not in fields and not k.startswith("_")]


def resolve_heads(model: str | None, target_model_config) -> Path:
    """Directory of the MTP heads checkpoint: ``model`` (a local folder or a hub repo id), else the heads
    registered for the target model.

    Raises:
        EntMTPConfigError: no ``model`` given and none registered for the target.
        HeadsCheckpointError: ``model`` is neither a local folder nor downloadable.
    """
    from vllm_entmtp.models import find_registered_heads

    if model is None:
        target = getattr(target_model_config, "model", None)
        found = find_registered_heads(str(target), getattr(target_model_config, "hf_config", None))
        if found is None:
            raise EntMTPConfigError(
                f"method 'entmtp': no MTP heads are registered for the target model {target!r}; pass the heads "
                "checkpoint as \"model\": \"<folder or hub id>\" in --speculative-config "
                "(train some with `vllm-entmtp train-heads`)")
        return found
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    try:  # a hub repo id, for users who can reach a hub
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id=model))
    except Exception as e:  # noqa: BLE001 - any failure means: not found
        raise HeadsCheckpointError(f"method 'entmtp': MTP heads \"model\": {model!r} is not a local folder and "
                                   f"could not be downloaded from a model hub ({type(e).__name__}: {e})") from e


def _check_heads_fit(heads_dir: Path, target_model_config) -> "object":
    cfg = read_any_heads_config(heads_dir)  # any supported layout (vllm_entmtp/heads/formats.py)
    hf = getattr(target_model_config, "hf_config", None)
    text = getattr(hf, "get_text_config", lambda: hf)() if hf is not None else None
    for name in ("hidden_size", "vocab_size"):
        want = getattr(text, name, None)
        if want is not None and getattr(cfg, name) != want:
            raise HeadsCheckpointError(
                f"MTP heads {heads_dir} do not fit the target model {getattr(target_model_config, 'model', '?')}: "
                f"heads {name}={getattr(cfg, name)}, target {name}={want}")
    return cfg


def _draft_budget(options, heads_cfg, heads_dir, num_spec: int | None):
    """``(num_speculative_tokens, static tree id, static tree, tree-set path)`` for the options.

    Scheduled trees (policy other than "static"): the set and its schedule are validated here, at start-up, and a
    step carries at most the largest tree, or a prompt-lookup chain of ``lookup_tokens`` when that is longer. A static tree: its node count. Chains: one token per head at most.

    Raises:
        EntMTPConfigError: a ``num_speculative_tokens`` that contradicts the trees or the heads.
        TreeSetError, SchedulerError: a bad tree, tree set or schedule (named).
    """
    if options.policy != "static":
        from vllm_entmtp.scheduler import TreeScheduler
        from vllm_entmtp.trees import load_tree_set

        tree_set = load_tree_set(options.tree_set, num_heads=heads_cfg.num_heads)
        ladder = TreeScheduler.from_config(options, tree_set).ladder
        largest = max([t.num_nodes for t in ladder if t is not None] or [1])  # "none" bins draft nothing
        in_set = max(t.num_nodes for _, t in tree_set.trees)
        if options.draft_sources != "heads":  # prompt lookup drafts chains of up to lookup_tokens
            largest = max(largest, options.lookup_tokens)
            in_set = max(in_set, options.lookup_tokens)
        if num_spec is not None and not largest <= num_spec <= in_set:
            raise EntMTPConfigError(
                f"method 'entmtp': num_speculative_tokens={num_spec}, but the scheduled trees of tree_set "
                f"{options.tree_set!r} need {largest} and its largest tree has {in_set} nodes; leave "
                f"num_speculative_tokens out (= {largest}), or give {largest}..{in_set} to let requests hold "
                f"larger trees of the set (extra_args entmtp_tree_id)")
        return num_spec or largest, None, None, str(tree_set.source)
    tree_id, tree = resolve_static_tree(options, heads_cfg.num_heads)
    if tree is not None:  # a tree is verified whole: the step's draft-token budget is its node count
        if num_spec is not None and num_spec != tree.num_nodes:
            raise EntMTPConfigError(
                f"method 'entmtp': num_speculative_tokens={num_spec} but the tree has {tree.num_nodes} nodes; "
                "leave num_speculative_tokens out with a tree")
        return tree.num_nodes, tree_id, tree, None
    if num_spec is None:
        return heads_cfg.num_heads, None, None, None
    if num_spec > heads_cfg.num_heads:
        raise EntMTPConfigError(
            f"method 'entmtp': num_speculative_tokens={num_spec} but the heads {heads_dir} have "
            f"{heads_cfg.num_heads} heads, and a chain of draft tokens takes one token per head; allowed: "
            f"1..{heads_cfg.num_heads}")
    return num_spec, None, None, None


def lookup_bounds(spec) -> tuple[int, int]:
    """``(prompt_lookup_min, prompt_lookup_max)`` of a SpeculativeConfig for entmtp's prompt lookup (entmtp's
    defaults where the user gave neither; one given alone bounds the other's default).

    Raises:
        EntMTPConfigError: ``prompt_lookup_min`` > ``prompt_lookup_max``."""
    from vllm_entmtp.lookup import DEFAULT_LOOKUP_MAX, DEFAULT_LOOKUP_MIN

    lo, hi = getattr(spec, "prompt_lookup_min", None), getattr(spec, "prompt_lookup_max", None)
    lo_ = lo if lo is not None else min(DEFAULT_LOOKUP_MIN, hi or DEFAULT_LOOKUP_MIN)
    hi_ = hi if hi is not None else max(DEFAULT_LOOKUP_MAX, lo or 0)
    if lo_ > hi_:
        raise EntMTPConfigError(f"method 'entmtp': prompt_lookup_min={lo_} must be <= prompt_lookup_max={hi_}")
    return lo_, hi_


def apply() -> None:
    from pydantic.dataclasses import rebuild_dataclass
    from vllm.config import speculative as S

    SC = S.SpeculativeConfig
    if getattr(SC, "_entmtp_patched", False):
        return
    # 1. "entmtp" becomes a valid method; extra keys are let through to __post_init__, which validates them.
    SC.__pydantic_config__["extra"] = "allow"
    lit = Union[S.SpeculativeMethod, Literal[METHOD]] | None
    SC.__annotations__["method"] = lit
    SC.__dataclass_fields__["method"].type = lit
    vllm_keys = vllm_speculative_keys()
    orig_post_init = SC.__post_init__

    def __post_init__(self) -> None:
        extras = {k: getattr(self, k) for k in _extra_keys(self)}
        for k in extras:
            delattr(self, k)
        if self.method != METHOD:
            if extras:  # vLLM forbids unknown keys; keep it so for every other method
                raise ValueError(f"unknown key(s) {sorted(extras)} in the speculative config "
                                 f"(method {self.method!r}); allowed keys: {', '.join(vllm_keys)}")
            return orig_post_init(self)
        options = parse_entmtp_options(extras, vllm_keys)
        if self.target_model_config is None:
            raise EntMTPConfigError("method 'entmtp' needs the target model's config (target_model_config)")
        pp = getattr(self.target_parallel_config, "pipeline_parallel_size", 1) or 1
        if pp > 1:  # the drafter, its tree rows and the tree attention live on the last stage only
            raise EntMTPConfigError(
                f"method 'entmtp' does not support pipeline parallelism (pipeline_parallel_size={pp}): the other "
                "stages would attend causally to tree rows; serve with --pipeline-parallel-size 1 (tensor "
                "parallelism is supported)")
        heads_dir = resolve_heads(self.model, self.target_model_config)
        heads_cfg = _check_heads_fit(heads_dir, self.target_model_config)
        options = resolve_policy(options, self.num_speculative_tokens is not None, heads_cfg.num_heads)
        # vLLM's prompt_lookup_min / _max, for entmtp's prompt lookup (vLLM's medusa set-up zeroes them)
        lookup = lookup_bounds(self)
        if options.confidence_heads > heads_cfg.num_heads:
            raise EntMTPConfigError(
                f"method 'entmtp': confidence_heads={options.confidence_heads}, but the heads {heads_dir} have "
                f"{heads_cfg.num_heads}; allowed: 1..{heads_cfg.num_heads}")
        (self.num_speculative_tokens, tree_id, tree,
         self.entmtp_tree_set_path) = _draft_budget(options, heads_cfg, heads_dir, self.num_speculative_tokens)
        self.model = str(heads_dir)
        self.method = INNER_METHOD
        orig_post_init(self)
        if not getattr(SC, "_entmtp_explained", False):  # once per process
            SC._entmtp_explained = True
            logger.info("entmtp: runs inside vLLM as its %r method (same plumbing: the heads read the target's "
                        "hidden states), so vLLM's own lines about 'MedusaModel', %r-based speculative decoding "
                        "and SpeculativeConfig(method=%r) refer to entmtp", INNER_METHOD, INNER_METHOD,
                        INNER_METHOD)
        # FasterDecoding configs may lack hidden_size (vLLM's MedusaConfig then says 4096): take the heads'.
        draft = self.draft_model_config
        draft.hf_config.hidden_size = draft.model_arch_config.hidden_size = heads_cfg.hidden_size
        # Read by the runner patch in every process (survives pickling to the engine core and workers).
        self.entmtp = options
        self.entmtp_heads = str(heads_dir)
        self.entmtp_tree = [list(p) for p in tree.paths] if tree is not None else None
        self.entmtp_tree_id = tree_id
        self.entmtp_lookup = lookup

    SC.__post_init__ = __post_init__
    rebuild_dataclass(SC, force=True)
    SC._entmtp_patched = True


def entmtp_options(speculative_config) -> "object | None":
    """The validated :class:`~vllm_entmtp.config.EntMTPConfig` of a SpeculativeConfig, or None if not entmtp."""
    return getattr(speculative_config, "entmtp", None)
