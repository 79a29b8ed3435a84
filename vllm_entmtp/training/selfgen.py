"""Self-distillation text: the target model's own greedy replies to train-split prompts.

``vllm-entmtp self-distill --out DIR`` asks the target (vLLM, greedy, temperature 0) to answer train-split
prompts and writes one conversation per line to ``DIR/<source>.jsonl`` (``{"id", "messages": [user,
assistant]}``); ``vllm-entmtp train-heads --generated DIR --mix sharegpt-gen=...,gsm8k-gen=...,code-gen=...``
then trains on them like on any other text (the target pass labels every position with the target's argmax,
which on its own greedy reply is the reply's next token).

Why: the heads serve greedy decoding, i.e. the target's own text. On dataset text the label at ``t + k + 1`` is
the target's prediction after *human* tokens ``t + 1 .. t + k`` that the head never sees; on the target's
replies it is the next token of the reply. Medusa (Cai et al. 2024, section 2.3.2, "Self-Distillation") trains on
the target's own replies to the training prompts; Hydra++ (Ankner et al. 2024) distils from the base model too.
Here: the shipped Medusa heads, trained on 267k positions of dataset text, reach a held-out top-1 of 0.21 for
head 0, while an earlier probe on this machine, trained on 35k positions of the target's greedy replies,
reached 0.30.

Prompt sources (never an eval prompt; :mod:`vllm_entmtp.datasets`):

* ``sharegpt``: first user turns of train-split ShareGPT conversations, minus those equal to an eval prompt;
* ``gsm8k``: train-split GSM8K questions (rows 300-1318) in the eval prompts' template;
* ``code``: "Complete this Python function" prompts (the HumanEval template) built from documented top-level
  functions of the CPython standard library (signature and docstring); no HumanEval problem is used;
* ``pycode``: the same template from documented top-level functions of pure-Python packages installed with
  vLLM (:data:`PYCODE_PACKAGES`: networkx, sympy, numpy, ...): the signature and the docstring's first
  paragraph only (their docstrings are long reference pages; HumanEval's are one paragraph). The standard
  library gives only ~1,200 such prompts; code replies are where the heads gain most (HumanEval).

Generation resumes: prompts whose id is already in ``DIR/<source>.jsonl`` are skipped, and lines are appended
per batch, so an interrupted run loses at most one batch.
"""
from __future__ import annotations

import argparse
import ast
import inspect
import json
import random
import sys
import textwrap
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from vllm_entmtp.datasets import HUMANEVAL_TEMPLATE, Prompt, TrainingDoc, load_prompts, stdlib_sources

SOURCES = ("sharegpt", "gsm8k", "code", "pycode")
GEN_SUFFIX = "-gen"  # training source name of a source's generated replies: "sharegpt-gen", ...
DEFAULT_COUNTS = {"sharegpt": 3000, "gsm8k": 1000, "code": 1000}
MAX_PROMPT_CHARS = 2000
MAX_PROMPT_TOKENS = 2048  # the engine's context: prompt (2,000 characters fit) + reply
MAX_DOCSTRING_CHARS = 800
MIN_SUMMARY_CHARS = 30  # pycode: a docstring's first paragraph shorter than this says too little to implement
#: pure-Python packages of the vLLM environment whose documented functions make ``pycode`` prompts (pinned with
#: vLLM's own requirements, so the prompt list is the same on every machine with that environment)
PYCODE_PACKAGES = ("networkx", "sympy", "mpmath", "numpy", "jinja2", "pygments", "packaging", "requests",
                   "click", "attr", "tqdm", "yaml", "dateutil")

#: ``generate(list of chat messages) -> list of reply texts``, one reply per conversation, in order.
GenerateFn = Callable[[list[list[dict]]], list[str]]


def _log(msg: str) -> None:
    print(f"[self-distill] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------ prompts
def stdlib_function_prompts(root: Path | None = None) -> list[Prompt]:
    """HumanEval-style prompts from documented top-level functions of the CPython standard library: the ``def``
    line(s) and the docstring, in the HumanEval template (``datasets.HUMANEVAL_TEMPLATE``); sorted by module path
    and line. Private functions, methods, tests, and docstrings over ``MAX_DOCSTRING_CHARS`` are left out."""
    out = []
    for rel, text in stdlib_sources(root):
        out += _function_prompts(rel, text, summary_only=False)
    return out


def package_function_prompts(packages: Sequence[str] = PYCODE_PACKAGES, root: Path | None = None) -> list[Prompt]:
    """HumanEval-style prompts (source ``pycode``) from documented top-level functions of installed pure-Python
    ``packages`` (folders under ``root``, default this interpreter's site-packages; a missing one is skipped):
    the ``def`` line(s) and the first paragraph of the docstring (at least ``MIN_SUMMARY_CHARS``), decorators
    left out of the prompt; functions whose body is only the docstring, private ones, methods and test folders
    are left out. Sorted by package order, module path and line."""
    import sysconfig

    root = Path(root or sysconfig.get_paths()["purelib"])
    skip = ("tests", "test", "testing", "benchmarks", "__pycache__")
    out = []
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            rel = path.relative_to(root)
            if any(part in skip for part in rel.parts[:-1]) or rel.name.startswith("test_"):
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            out += _function_prompts(rel, text, summary_only=True, source="pycode")
    return out


def _function_prompts(rel: Path, text: str, summary_only: bool, source: str = "code") -> list[Prompt]:
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines()
    out = []
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_") or not node.body:
            continue
        if node.decorator_list and not summary_only:
            continue
        doc = ast.get_docstring(node, clean=False)
        if not doc:
            continue
        first = node.body[0]  # the docstring expression
        if summary_only:
            summary = inspect.cleandoc(doc).split("\n\n")[0].strip()
            if len(summary) < MIN_SUMMARY_CHARS or len(node.body) < 2 or '"""' in summary:
                continue
            if not lines[first.lineno - 1].lstrip().lstrip("rRuU").startswith(('"', "'")):
                continue  # the docstring shares its line with the signature: the prompt would lose the def
            indent = " " * first.col_offset
            body = textwrap.indent(summary, indent).lstrip()
            head = "\n".join(lines[node.lineno - 1:first.lineno - 1] + [f'{indent}"""{body}\n{indent}"""'])
        else:
            if len(doc) > MAX_DOCSTRING_CHARS:
                continue
            head = "\n".join(lines[node.lineno - 1:first.end_lineno]).rstrip()
        out.append(Prompt(source, f"{source}/{rel.as_posix()}:{node.name}",
                          [{"role": "user", "content": HUMANEVAL_TEMPLATE.format(prompt=head)}]))
    return out


def generation_prompts(source: str, limit: int | None = None, seed: int = 0) -> list[Prompt]:
    """The first ``limit`` prompts of ``source`` (one of :data:`SOURCES`) in a seeded shuffle; user turns longer
    than ``MAX_PROMPT_CHARS`` are left out.

    Raises:
        ValueError: unknown source.
    """
    if source == "sharegpt":
        eval_texts = {p.messages[0]["content"].strip() for p in load_prompts("sharegpt", split="eval")}
        prompts = [p for p in load_prompts("sharegpt", split="train")
                   if p.messages[0]["content"].strip() not in eval_texts]
    elif source == "gsm8k":
        prompts = load_prompts("gsm8k", split="train")
    elif source == "code":
        prompts = stdlib_function_prompts()
    elif source == "pycode":
        prompts = package_function_prompts()
    else:
        raise ValueError(f"unknown self-distillation source {source!r}; valid: {', '.join(SOURCES)}")
    prompts = [p for p in prompts if len(p.messages[-1]["content"]) < MAX_PROMPT_CHARS]
    seen, unique = set(), []
    for p in prompts:  # ShareGPT repeats first turns
        key = p.messages[-1]["content"].strip()
        if key not in seen:
            seen.add(key)
            unique.append(p)
    random.Random(f"{seed}:{source}").shuffle(unique)
    return unique if limit is None else unique[:limit]


# ------------------------------------------------------------------------------------------ generation
def done_ids(path: Path) -> set[str]:
    """Ids already written to ``path`` (a torn last line, from a run killed mid-write, is ignored)."""
    if not path.is_file():
        return set()
    ids = set()
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            ids.add(json.loads(line)["id"])
        except (ValueError, KeyError, TypeError):
            continue
    return ids


def generate_replies(prompts: Sequence[Prompt], out: Path, generate: GenerateFn, batch: int = 256,
                     progress=None) -> int:
    """Appends ``{"id", "messages": [user, assistant]}`` per prompt not yet in ``out``, ``batch`` prompts per
    ``generate`` call; returns how many were generated (empty replies included: they are written, so a rerun
    does not ask again, and :func:`read_generated` leaves them out)."""
    have = done_ids(out)
    todo = [p for p in prompts if p.id not in have]
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.is_file() and out.stat().st_size and not out.read_bytes().endswith(b"\n"):
        with open(out, "a", encoding="utf-8") as f:  # end a torn line, so the next record starts on its own
            f.write("\n")
    n = 0
    for i in range(0, len(todo), batch):
        chunk = todo[i:i + batch]
        replies = generate([p.messages for p in chunk])
        if len(replies) != len(chunk):
            raise RuntimeError(f"generate returned {len(replies)} replies for {len(chunk)} prompts")
        lines = [json.dumps({"id": p.id, "messages": [*p.messages, {"role": "assistant", "content": r}]})
                 for p, r in zip(chunk, replies)]
        with open(out, "a", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in lines))
        n += len(chunk)
        if progress is not None:
            progress.update(len(chunk))
    return n


def llm_generate_fn(llm, max_tokens: int) -> GenerateFn:
    """Greedy replies (temperature 0, ``max_tokens`` at most) of a vLLM ``LLM`` through its chat template."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)

    def generate(conversations: list[list[dict]]) -> list[str]:
        return [o.outputs[0].text for o in llm.chat(conversations, params, use_tqdm=False)]

    return generate


def vllm_generate_fn(model: str, max_tokens: int, max_num_seqs: int, dtype: str) -> GenerateFn:
    """:func:`llm_generate_fn` of a new vLLM engine of ``model`` without speculation."""
    from vllm_entmtp.harness import make_llm

    llm = make_llm(model, None, dtype=dtype, max_model_len=MAX_PROMPT_TOKENS + max_tokens,
                   max_num_seqs=max_num_seqs)
    return llm_generate_fn(llm, max_tokens)


def read_generated(gen_dir: str | Path, source: str) -> list[TrainingDoc]:
    """The conversations of ``gen_dir/<source>.jsonl`` as training documents of source ``<source>-gen``.

    Raises:
        FileNotFoundError: no such file (run ``vllm-entmtp self-distill`` first).
    """
    path = Path(gen_dir) / f"{source}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no self-distilled replies for source {source!r}; run "
                                f"`vllm-entmtp self-distill --out {gen_dir}` first")
    docs = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
            msgs = rec["messages"]
            if msgs[-1]["role"] == "assistant" and msgs[-1]["content"].strip():
                docs.append(TrainingDoc(source + GEN_SUFFIX, "gen/" + rec["id"], msgs))
        except (ValueError, KeyError, TypeError, IndexError):
            continue  # a torn line
    return docs


# ------------------------------------------------------------------------------------------ command
def _counts(text: str) -> dict[str, int]:
    out = {}
    for part in text.split(","):
        name, _, n = part.partition("=")
        if name.strip() not in SOURCES or not n.strip().isdigit():
            raise argparse.ArgumentTypeError(f"bad --prompts {text!r}: expected source=count with sources "
                                             f"{', '.join(SOURCES)}, e.g. sharegpt=3000,gsm8k=1000")
        out[name.strip()] = int(n)
    return out


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return n


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="folder of the <source>.jsonl files (appended to; resumes)")
    p.add_argument("--model", default=None, help="target model folder (default: the prepared default model)")
    p.add_argument("--prompts", type=_counts, default=dict(DEFAULT_COUNTS),
                   help="prompts per source (default: %s)" % ",".join(f"{k}={v}" for k, v in DEFAULT_COUNTS.items()))
    p.add_argument("--max-tokens", type=_positive, default=256, help="reply tokens at most (default: %(default)s)")
    p.add_argument("--max-num-seqs", type=_positive, default=64, help="requests in flight (default: %(default)s)")
    p.add_argument("--batch", type=_positive, default=256, help="prompts per write (default: %(default)s)")
    p.add_argument("--dtype", default="float32",
                   help="the target's dtype; float32 is what the heads are served with here (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="prompt order (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from vllm_entmtp.models import prepare_default_model

    out = Path(args.out)
    plan = {s: generation_prompts(s, n, args.seed) for s, n in args.prompts.items() if n > 0}
    todo = {}
    for s, ps in plan.items():
        have = done_ids(out / f"{s}.jsonl")
        todo[s] = [p for p in ps if p.id not in have]
    total = sum(len(v) for v in todo.values())
    _log(", ".join(f"{s}: {len(plan[s])} prompts, {len(plan[s]) - len(todo[s])} done" for s in plan))
    if not total:
        _log(f"nothing to do; replies in {out}")
        return 0
    model = args.model or str(prepare_default_model())
    check_config(out, {"model": model, "max_tokens": args.max_tokens, "dtype": args.dtype, "temperature": 0.0})
    generate = vllm_generate_fn(model, args.max_tokens, args.max_num_seqs, args.dtype)
    t0 = time.time()
    with tqdm(total=total, desc="self-distill", unit="prompt") as bar:
        for s, prompts in todo.items():
            generate_replies(prompts, out / f"{s}.jsonl", generate, args.batch, progress=bar)
    _log(f"{total} replies in {time.time() - t0:.0f} s; {out}")
    return 0


def check_config(out: Path, cfg: dict) -> None:
    """Writes ``out/config.json`` (how the replies are generated), or checks that an existing one matches, so
    one folder never mixes replies of different targets or settings.

    Raises:
        SystemExit: ``out`` holds replies generated otherwise (names both settings).
    """
    path = out / "config.json"
    if path.is_file():
        old = json.loads(path.read_text())
        if old != cfg:
            raise SystemExit(f"{out} holds replies generated with {old}, not {cfg}: use another --out")
        return
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cfg, indent=2) + "\n")
