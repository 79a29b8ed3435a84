"""The methods ``benchmarks/compare.py`` compares: each a name and a ``--speculative-config`` (or none), which of
them this checkout can run (its shipped heads and tree sets), the tasks, and the order they run in per repeat."""
from __future__ import annotations

import json
from dataclasses import dataclass

from throughput import BenchmarkError

TASKS = ("humaneval", "gsm8k", "sharegpt", "creative", "mixed")  # mixed: the four in turn, one batch of all kinds
TUNED_TASKS = TASKS[:4]  # those with a tree set of their own (entmtp-<task>) and a speed target
EXTRA_TASKS = ("sharegpt-long",)  # on request only: chat with its earlier turns, contexts of 700-1,800 tokens
STATIC_TREES = ("b0n1", "b0n2", "b0n3", "b2n4")
"""Trees of the set ``default`` that ``static-<id>`` drafts for every request and step (chains of 1-3 tokens and a
tree of 4 nodes), heads only, on the mixed task: the static configurations the per-request schedule must beat."""
BASELINES = ("ngram", "vllm-medusa", "medusa-tree", "hydra-tree", "entmtp-heads")  # a "vs" column each, if run
#: Plain decoding: in the run's dtype, and in each dtype named. ``plain-best`` (not a server of its own) is, per
#: task, concurrency and repeat, the fastest of those that ran: the baseline every speed claim is made against.
PLAIN_METHODS = ("plain", "plain-float32", "plain-bfloat16")
PLAIN_BEST = "plain-best"
SERVED_MODEL_NAME = "SmolLM2-135M-Instruct"
STATIC_TREE = {"tree_set": "ladder", "tree_id": "mc12"}


@dataclass(frozen=True)
class Method:
    name: str
    spec: dict | None  # --speculative-config; None: no speculation
    note: str = ""
    only_task: str | None = None  # runs this task only (a tree set tuned to it); None: every task
    dtype: str | None = None  # the server's --dtype; None: the run's (``--serve-args`` or the machine's default)


def is_entmtp(spec: dict | None) -> bool:
    return bool(spec) and spec.get("method") == "entmtp"


def method_order(tasks=TASKS) -> list[str]:
    return [*PLAIN_METHODS, "ngram", "vllm-medusa", "medusa-tree", "hydra-tree", "entmtp", "entmtp-heads",
            "entmtp-no-draft", "entmtp-vllm-attention", *(f"static-{t}" for t in STATIC_TREES),
            *(f"entmtp-{t}" for t in tasks if t in TUNED_TASKS)]


def method_table(heads: dict, tree_sets: dict, preferred_kinds=("hydra", "medusa")
                 ) -> tuple[dict[str, Method], dict[str, str]]:
    """``(available, skipped)``: the methods that can run, in report order, and ``{name: why not}``.

    ``heads``: shipped heads ``{kind: dir}`` (:func:`vllm_entmtp.models.default_heads`); ``tree_sets``: ``{name:
    file}`` (:func:`vllm_entmtp.trees.available_tree_sets`); ``preferred_kinds``: which heads ``{"method":
    "entmtp"}`` takes (:data:`vllm_entmtp.models.PREFERRED_KINDS`).
    """
    available: dict[str, Method] = {}
    skipped: dict[str, str] = {}

    def add(name: str, spec: dict | None, note: str = "", missing: str | None = None,
            only_task: str | None = None, dtype: str | None = None) -> None:
        if missing:
            skipped[name] = missing
        else:
            available[name] = Method(name, spec, note, only_task, dtype)

    def no_heads(kind: str) -> str | None:
        return None if kind in heads else f"no {kind.capitalize()} heads are shipped for {SERVED_MODEL_NAME}"

    add("plain", None, "no speculation, the run's dtype")
    for dtype in ("float32", "bfloat16"):
        add(f"plain-{dtype}", None, f"no speculation, {dtype}", dtype=dtype)
    add("ngram", {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
        "vLLM's prompt lookup: a chain of 4")
    medusa = str(heads.get("medusa", ""))
    add("vllm-medusa", {"method": "medusa", "model": medusa, "num_speculative_tokens": 4},
        "vLLM's Medusa: a chain of 4", no_heads("medusa"))
    add("medusa-tree", {"method": "entmtp", "model": medusa, **STATIC_TREE},
        "entmtp, Medusa heads, static tree mc12", no_heads("medusa"))
    add("hydra-tree", {"method": "entmtp", "model": str(heads.get("hydra", "")), **STATIC_TREE},
        "entmtp, Hydra heads, static tree mc12", no_heads("hydra"))
    kind = next((k for k in preferred_kinds if k in heads), None)
    add("entmtp", {"method": "entmtp"}, f"entmtp defaults: {kind} heads, trees of the set 'default' scheduled "
        "by its schedule's signal", None if kind else f"no heads are shipped for {SERVED_MODEL_NAME}")
    add("entmtp-heads", {"method": "entmtp", "draft_sources": "heads"}, "entmtp defaults, drafts from the MTP "
        "heads only (no prompt lookup)", None if kind else f"no heads are shipped for {SERVED_MODEL_NAME}")
    add("entmtp-no-draft", {"method": "entmtp", "load_policy": "cap", "max_verify_tokens_per_step": 1},
        "entmtp defaults but a cap of one verified row a request-step: nothing is drafted (what vLLM's "
        "speculative mode and the plugin's per-step work cost)", None if kind else
        f"no heads are shipped for {SERVED_MODEL_NAME}")
    add("entmtp-vllm-attention", {"method": "entmtp", "verify_attention": "vllm"},
        "entmtp defaults but vLLM's attention kernel for the rows of draft tokens too (verify_attention 'vllm')",
        None if kind else f"no heads are shipped for {SERVED_MODEL_NAME}")
    for tree_id in STATIC_TREES:
        add(f"static-{tree_id}", {"method": "entmtp", "policy": "static", "tree_set": "default",
                                  "tree_id": tree_id},
            f"entmtp defaults but one static tree, {tree_id} of the set 'default', for every request and step "
            "(heads only; mixed only)", None if kind else f"no heads are shipped for {SERVED_MODEL_NAME}",
            only_task="mixed")
    for task in TUNED_TASKS:
        missing = (None if task in tree_sets else f"no tree set named {task!r} (trees/{task}.json)") \
            or (None if kind else f"no heads are shipped for {SERVED_MODEL_NAME}")
        add(f"entmtp-{task}", {"method": "entmtp", "tree_set": task},
            f"entmtp, tree set {task}, scheduled by its signal ({task} only)", missing, only_task=task)
    return available, skipped


def shipped_method_table() -> tuple[dict[str, Method], dict[str, str]]:
    """:func:`method_table` of the heads and tree sets this checkout ships."""
    from vllm_entmtp.models import PREFERRED_KINDS, default_heads
    from vllm_entmtp.trees import available_tree_sets

    return method_table(default_heads(), available_tree_sets(), PREFERRED_KINDS)


def custom_method(text: str, available: dict[str, Method], skipped: dict[str, str]) -> Method:
    """A method of ``--add-method NAME=SPEC``: ``SPEC``, a JSON object, is its ``--speculative-config`` (entmtp's
    keys checked here, as a server would at start-up).

    Raises:
        BenchmarkError: no ``=``, a name that is taken or not of letters, digits, ``.``, ``_`` and ``-``, a
        ``SPEC`` that is not a JSON object with a ``method``, or an entmtp option the plugin rejects.
    """
    import re

    name, sep, spec_text = text.partition("=")
    name = name.strip()
    if not sep:
        raise BenchmarkError(f"--add-method takes NAME=SPEC (SPEC a --speculative-config JSON object), got {text!r}")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
        raise BenchmarkError(f"--add-method: name {name!r}: use letters, digits, '.', '_' and '-'")
    if name in available or name in skipped or name in method_order():
        raise BenchmarkError(f"--add-method: {name!r} is taken (a built-in method, or an earlier --add-method); "
                             "choose another name")
    try:
        spec = json.loads(spec_text)
    except ValueError as e:
        raise BenchmarkError(f"--add-method {name}: SPEC is not JSON: {e}") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("method"), str):
        raise BenchmarkError(f"--add-method {name}: SPEC must be a JSON object with a \"method\", got {spec_text!r}")
    if is_entmtp(spec):
        from vllm_entmtp.config import EntMTPConfigError, parse_entmtp_options
        from vllm_entmtp.patches.config import vllm_speculative_keys

        vllm_keys = vllm_speculative_keys()
        try:
            parse_entmtp_options({k: v for k, v in spec.items() if k not in vllm_keys}, vllm_keys)
        except EntMTPConfigError as e:
            raise BenchmarkError(f"--add-method {name}: {e}") from None
    return Method(name, spec, f"--add-method: {json.dumps(spec)}")


def select_methods(text: str | None, available: dict[str, Method], skipped: dict[str, str]) -> list[Method]:
    """Methods named in ``text`` (comma-separated, None: all available), in the order given."""
    if text is None:
        return list(available.values())
    names = _split_list(text, "--methods")
    out = []
    for name in names:
        if name in skipped:
            raise BenchmarkError(f"method {name!r} is not available: {skipped[name]}")
        if name not in available:
            raise BenchmarkError(f"unknown method {name!r}; known: {', '.join(method_order())}")
        out.append(available[name])
    return out


def parse_tasks(text: str) -> list[str]:
    tasks = _split_list(text, "--tasks")
    for t in tasks:
        if t not in TASKS + EXTRA_TASKS:
            raise BenchmarkError(f"unknown task {t!r}; tasks: {', '.join(TASKS + EXTRA_TASKS)}")
    return tasks


def _split_list(text: str, option: str) -> list[str]:
    """``"a, b,a"`` -> ``["a", "b"]`` (first occurrence kept); an empty list is an error."""
    items = list(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))
    if not items:
        raise BenchmarkError(f"{option} needs at least one name, got {text!r}")
    return items


def interleaved_order(methods: list, repeat: int) -> list:
    """The order of ``methods`` in repeat ``repeat`` (0-based): rotated left by ``repeat``, so that over
    ``len(methods)`` repeats every method runs once in every position."""
    if not methods:
        return []
    k = repeat % len(methods)
    return methods[k:] + methods[:k]
