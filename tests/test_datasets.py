"""Prompt sets and head-training text read from the installed data packages (real files, a few seconds), and
JSONL prompt files."""
import json

import pytest

from vllm_entmtp.datasets import (GSM8K_EVAL_ROWS, MIXED_SETS, PROMPT_SETS, SHAREGPT_LONG_CHARS, Prompt,
                                  PromptFileError, load_prompts, read_jsonl_prompts, sharegpt_split,
                                  training_conversations)


@pytest.mark.parametrize("name,count", [("humaneval", 164), ("gsm8k", GSM8K_EVAL_ROWS), ("mtbench", 80),
                                        ("creative", 143)])
def test_eval_counts(name, count):
    assert len(load_prompts(name)) == count


@pytest.mark.parametrize("name", PROMPT_SETS)
def test_fields_non_empty_and_unique(name):
    prompts = load_prompts(name)
    assert prompts and all(isinstance(p, Prompt) for p in prompts)
    for p in prompts:
        assert (p.dataset in MIXED_SETS if name == "mixed" else p.dataset == name) and p.id
        if name == "sharegpt-long":
            continue
        assert len(p.messages) == 1 and p.messages[0]["role"] == "user"
        assert p.messages[0]["content"].strip()
    assert len({p.id for p in prompts}) == len(prompts)


def test_sharegpt_long_is_a_conversation_up_to_a_user_turn():
    prompts = load_prompts("sharegpt-long")
    assert 500 < len(prompts) < 1200
    eval_ids = {p.id for p in load_prompts("sharegpt")}
    lo, hi = SHAREGPT_LONG_CHARS
    for p in prompts:
        roles = [m["role"] for m in p.messages]
        assert len(roles) >= 3 and roles == ["user", "assistant"] * (len(roles) // 2) + ["user"]
        assert all(m["content"].strip() for m in p.messages)
        assert lo <= sum(len(m["content"]) for m in p.messages) < hi
    # the eval split's conversations only (their first turns are sharegpt's eval prompts)
    assert len(eval_ids & {p.id for p in prompts}) > len(prompts) // 2
    assert not {p.id for p in prompts} & {p.id for p in load_prompts("sharegpt-long", split="train")}


def test_templates_and_order():
    he = load_prompts("humaneval", limit=2)
    assert [p.id for p in he] == ["HumanEval/0", "HumanEval/1"]
    assert he[0].messages[0]["content"].startswith("Complete this Python function:\n\n```python\nfrom typing")
    assert he[0].messages[0]["content"].endswith("\n```")
    g = load_prompts("gsm8k", limit=1)[0]
    assert g.id == "gsm8k/0"
    assert g.messages[0]["content"].startswith("Solve this grade school math problem. Show your reasoning and "
                                               "end with the final answer.\n\nJanet")
    assert load_prompts("sharegpt", limit=5) == load_prompts("sharegpt", limit=5)


def test_limit():
    assert len(load_prompts("mtbench", limit=7)) == 7


def test_splits_disjoint():
    g_eval = {p.id for p in load_prompts("gsm8k")}
    g_train = {p.id for p in load_prompts("gsm8k", split="train")}
    assert len(g_eval) == 300 and len(g_train) == 1319 - 300 and not g_eval & g_train
    s_eval = load_prompts("sharegpt")
    s_train = load_prompts("sharegpt", split="train")
    assert 900 < len(s_eval) < 1300 and len(s_train) > 9000
    assert not {p.id for p in s_eval} & {p.id for p in s_train}
    # all parts of one conversation share a split
    assert sharegpt_split("abc_0") == sharegpt_split("abc_7")


def test_training_text_excludes_eval_prompts():
    docs = training_conversations(sources=("sharegpt", "gsm8k"))
    eval_ids = {p.id for n in ("gsm8k", "sharegpt") for p in load_prompts(n)}
    eval_texts = {p.messages[0]["content"] for p in load_prompts("sharegpt")}
    assert len(docs["gsm8k"]) == 1019 and len(docs["sharegpt"]) > 12000
    for src in docs.values():
        for d in src:
            assert d.id not in eval_ids
            assert d.messages[0]["role"] == "user" and d.messages[1]["role"] == "assistant"
    assert not {d.messages[0]["content"] for d in docs["sharegpt"]} & eval_texts
    assert "<<" not in docs["gsm8k"][0].messages[1]["content"]


def test_unknown_names():
    with pytest.raises(ValueError, match="humaneval, gsm8k, sharegpt, mtbench, creative"):
        load_prompts("nope")
    with pytest.raises(ValueError, match="eval only"):
        load_prompts("humaneval", split="train")
    with pytest.raises(ValueError, match="split"):
        load_prompts("gsm8k", split="test")


def test_max_chars_keeps_only_shorter_prompts():
    short = load_prompts("sharegpt", limit=5, max_chars=300)
    assert len(short) == 5 and all(len(p.messages[-1]["content"]) < 300 for p in short)
    assert any(len(p.messages[-1]["content"]) >= 300 for p in load_prompts("sharegpt", limit=40))


def test_jsonl_prompt_file(tmp_path):
    path = tmp_path / "mine.jsonl"
    parts = [{"type": "text", "text": "two"}]
    path.write_text('{"prompt": "one \u2028 still one", "id": 7}\n\n'  # a raw U+2028 inside a string
                    '{"messages": [{"role": "user", "content": "two"}]}\r\n'
                    + json.dumps({"messages": [{"role": "user", "content": parts}]}) + "\n")
    assert read_jsonl_prompts(path, text_content=False) == [
        Prompt("mine", "7", [{"role": "user", "content": "one \u2028 still one"}]),
        Prompt("mine", "line3", [{"role": "user", "content": "two"}]),
        Prompt("mine", "line4", [{"role": "user", "content": parts}])]
    with pytest.raises(PromptFileError, match=r"mine.jsonl, line 4: expected an object with a \"prompt\"") as e:
        read_jsonl_prompts(path)  # content parts: not text a chat template renders
    assert (e.value.line, e.value.path) == (4, path)
    path.write_text('{"prompt": "ok"}\n{"prompt": \n')
    with pytest.raises(PromptFileError, match="line 2: malformed JSON"):
        read_jsonl_prompts(path)
    path.write_text("\n \n")
    assert read_jsonl_prompts(path) == []
    with pytest.raises(PromptFileError, match="cannot read") as e:
        read_jsonl_prompts(tmp_path / "absent.jsonl")
    assert e.value.line is None


def test_mixed_takes_the_four_sets_in_turn():
    mixed = load_prompts("mixed", limit=9)
    assert [p.dataset for p in mixed] == [*MIXED_SETS, *MIXED_SETS, "humaneval"]
    assert [p.id for p in mixed[:4]] == [load_prompts(n, limit=1)[0].id for n in MIXED_SETS]
    assert mixed[4].id == load_prompts("humaneval", limit=2)[1].id
    with pytest.raises(ValueError, match="eval only"):
        load_prompts("mixed", split="train")
