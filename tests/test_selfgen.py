"""vllm-entmtp self-distill: prompts, resumable reply files, and their use as training sources (no engine)."""
from __future__ import annotations

import json
import textwrap

import pytest

from vllm_entmtp.datasets import GSM8K_EVAL_ROWS, HUMANEVAL_TEMPLATE, Prompt
from vllm_entmtp.training import data as D
from vllm_entmtp.training import selfgen as G


def test_stdlib_function_prompts_are_humaneval_style(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(textwrap.dedent('''
        def add(a, b):
            """Return a + b.

            >>> add(1, 2)
            3
            """
            return a + b

        def _private(x):
            """Hidden."""

        def bare(x):
            return x

        class C:
            def method(self):
                """Methods are left out."""

        @staticmethod
        def decorated():
            """Decorated ones too."""
    '''))
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "t.py").write_text('def f():\n    """A test module."""\n')
    (tmp_path / "broken.py").write_text("def (:\n")
    prompts = G.stdlib_function_prompts(tmp_path)
    assert [p.id for p in prompts] == ["code/pkg/mod.py:add"]
    head = 'def add(a, b):\n    """Return a + b.\n\n    >>> add(1, 2)\n    3\n    """'
    assert prompts[0].messages == [{"role": "user", "content": HUMANEVAL_TEMPLATE.format(prompt=head)}]


def test_stdlib_function_prompts_of_this_python():
    prompts = G.stdlib_function_prompts()
    assert len(prompts) > 500
    assert len({p.id for p in prompts}) == len(prompts)
    assert all(p.messages[0]["content"].startswith("Complete this Python function:\n\n```python\ndef ")
               for p in prompts)


def test_package_function_prompts_keep_signature_and_first_paragraph(tmp_path):
    (tmp_path / "lib" / "tests").mkdir(parents=True)
    (tmp_path / "lib" / "algo.py").write_text(textwrap.dedent('''
        @dispatch
        def shortest(G, a,
                     b=None):
            """Return the shortest path from a to b in the graph G.

            Parameters
            ----------
            G : graph
            """
            return G.path(a, b)

        def tiny(x):
            """Too short."""
            return x

        def only_doc(x):
            """Return x unchanged, documented but without a body of its own."""

        def one_line(x): "Return x unchanged, with the docstring on the def line."; return x

        class K:
            def m(self):
                """Return a method's value, left out because methods are."""
                return 1
    '''))
    (tmp_path / "lib" / "tests" / "t.py").write_text('def f():\n    """A test module, left out."""\n    return 1\n')
    (tmp_path / "other").mkdir()
    prompts = G.package_function_prompts(("lib", "missing"), root=tmp_path)
    assert [p.id for p in prompts] == ["pycode/lib/algo.py:shortest"] and prompts[0].dataset == "pycode"
    head = 'def shortest(G, a,\n             b=None):\n    """Return the shortest path from a to b in the graph G.\n    """'
    assert prompts[0].messages == [{"role": "user", "content": HUMANEVAL_TEMPLATE.format(prompt=head)}]


def test_pycode_prompts_of_this_environment():
    # networkx only: all of PYCODE_PACKAGES (about 4,800 prompts; sympy's sources dominate) parse in ~20 s
    assert "networkx" in G.PYCODE_PACKAGES
    prompts = G.package_function_prompts(("networkx",))
    assert len(prompts) > 500 and len({p.id for p in prompts}) == len(prompts)
    assert all(p.id.startswith("pycode/networkx/") for p in prompts)
    assert all(p.messages[0]["content"].startswith("Complete this Python function:\n\n```python\ndef ")
               and '"""' in p.messages[0]["content"] for p in prompts)


def test_generation_prompts_are_train_split_seeded_and_unique():
    gsm = G.generation_prompts("gsm8k", 20, seed=0)
    assert len(gsm) == 20 and all(int(p.id.split("/")[1]) >= GSM8K_EVAL_ROWS for p in gsm)
    assert [p.id for p in gsm] == [p.id for p in G.generation_prompts("gsm8k", 20, seed=0)]
    assert [p.id for p in gsm] != [p.id for p in G.generation_prompts("gsm8k", 20, seed=1)]
    share = G.generation_prompts("sharegpt")
    from vllm_entmtp.datasets import load_prompts

    eval_texts = {p.messages[0]["content"].strip() for p in load_prompts("sharegpt", split="eval")}
    texts = [p.messages[0]["content"].strip() for p in share]
    assert len(texts) > 1000 and len(set(texts)) == len(texts) and not eval_texts.intersection(texts)
    assert all(len(t) < G.MAX_PROMPT_CHARS for t in texts)
    with pytest.raises(ValueError, match="unknown self-distillation source 'chat'; valid: sharegpt, gsm8k, code, pycode"):
        G.generation_prompts("chat")


def _prompts(n):
    return [Prompt("x", f"x/{i}", [{"role": "user", "content": f"q{i}"}]) for i in range(n)]


def test_generate_replies_appends_and_resumes(tmp_path):
    out = tmp_path / "gen" / "sharegpt.jsonl"
    calls = []

    def generate(convs):
        calls.append([c[-1]["content"] for c in convs])
        return ["" if c[-1]["content"] == "q1" else "reply to " + c[-1]["content"] for c in convs]

    assert G.generate_replies(_prompts(5), out, generate, batch=2) == 5
    assert calls == [["q0", "q1"], ["q2", "q3"], ["q4"]]
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in recs] == [f"x/{i}" for i in range(5)]
    assert recs[0]["messages"] == [{"role": "user", "content": "q0"}, {"role": "assistant", "content": "reply to q0"}]
    # a rerun asks only for what is missing; a torn last line (a killed run) is asked again
    with open(out, "a") as f:
        f.write('{"id": "x/5", "messa')
    calls.clear()
    assert G.generate_replies(_prompts(7), out, generate, batch=4) == 2
    assert calls == [["q5", "q6"]]
    assert G.done_ids(out) == {f"x/{i}" for i in range(7)}
    # read back as a training source: the empty reply and the torn line are left out
    docs = G.read_generated(tmp_path / "gen", "sharegpt")
    assert [d.id for d in docs] == ["gen/x/0", "gen/x/2", "gen/x/3", "gen/x/4", "gen/x/5", "gen/x/6"]
    assert {d.source for d in docs} == {"sharegpt-gen"}
    with pytest.raises(RuntimeError, match="returned 1 replies for 2 prompts"):
        G.generate_replies(_prompts(9), out, lambda convs: ["only one"], batch=2)


def test_read_generated_names_the_command_when_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"run `vllm-entmtp self-distill --out {tmp_path}` first"):
        G.read_generated(tmp_path, "gsm8k")


def test_training_docs_mix_text_and_replies(tmp_path):
    G.generate_replies(_prompts(3), tmp_path / "code.jsonl", lambda convs: ["def f(): pass"] * len(convs))
    docs = D.training_docs(["code-gen"], tmp_path)
    assert list(docs) == ["code-gen"] and len(docs["code-gen"]) == 3
    with pytest.raises(ValueError, match="pass --generated DIR"):
        D.training_docs(["gsm8k", "code-gen"])
    with pytest.raises(ValueError, match="unknown training sources \\['chat-gen'\\]"):
        D.training_docs(["chat-gen"], tmp_path)
    with pytest.raises(FileNotFoundError, match="no self-distilled replies for source 'sharegpt'"):
        D.training_docs(["sharegpt-gen"], tmp_path)


def test_config_of_a_reply_folder_is_never_mixed(tmp_path):
    cfg = {"model": "m", "max_tokens": 256, "dtype": "float32", "temperature": 0.0}
    G.check_config(tmp_path / "gen", cfg)
    G.check_config(tmp_path / "gen", dict(cfg))  # the same: fine
    with pytest.raises(SystemExit, match="holds replies generated with .*'max_tokens': 256.* not .*'max_tokens': 128"):
        G.check_config(tmp_path / "gen", {**cfg, "max_tokens": 128})


def test_command_arguments():
    import argparse

    p = argparse.ArgumentParser()
    G.add_arguments(p)
    args = p.parse_args(["--out", "d", "--prompts", "sharegpt=10,code=0"])
    assert args.prompts == {"sharegpt": 10, "code": 0} and args.dtype == "float32"
    for bad in (["--prompts", "chat=10"], ["--max-tokens", "0"], ["--max-num-seqs", "x"], ["--batch", "-1"]):
        with pytest.raises(SystemExit):
            p.parse_args(["--out", "d", *bad])
