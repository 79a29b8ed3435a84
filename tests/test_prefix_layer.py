"""Hydra++'s prefix layer (vllm_entmtp/heads/prefix.py) against Hugging Face's one-layer LlamaModel."""
import numpy as np
import pytest
import torch

from vllm_entmtp.heads.prefix import PrefixLayer, PrefixLayerConfig

HIDDEN = 64


def _pair(seed=0):
    from transformers import LlamaConfig, LlamaModel

    hf_cfg = LlamaConfig(hidden_size=HIDDEN, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=1, vocab_size=11, rms_norm_eps=1e-5, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
    torch.manual_seed(seed)
    hf = LlamaModel(hf_cfg).eval()
    for p in hf.parameters():  # norms start at one: give them values too
        torch.nn.init.normal_(p, std=0.2)
    ours = PrefixLayer(HIDDEN, PrefixLayerConfig.from_target_config(hf_cfg)).eval()
    state = {k: v for k, v in hf.state_dict().items() if not k.startswith("embed_tokens")}
    ours.load_state_dict(state, strict=True)  # the same names: Hydra++ checkpoints load as they are
    return hf, ours


def test_config_from_the_target():
    c = PrefixLayerConfig.from_target_config({"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
                                              "intermediate_size": 1536, "rms_norm_eps": 1e-5,
                                              "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}})
    assert (c.head_dim, c.num_key_value_heads, c.rope_theta) == (64, 3, 100000.0)
    with pytest.raises(ValueError, match="RoPE scaling"):
        PrefixLayerConfig.from_target_config({"hidden_size": 8, "num_attention_heads": 2, "intermediate_size": 8,
                                              "rope_scaling": {"type": "linear", "factor": 2.0}})
    with pytest.raises(ValueError, match="multiple"):
        PrefixLayerConfig(num_attention_heads=9, num_key_value_heads=2, head_dim=64, intermediate_size=8)


@torch.no_grad()
def test_matches_transformers_llama_layer_over_a_sequence():
    hf, ours = _pair()
    h = torch.randn(2, 13, HIDDEN)
    ref = hf(inputs_embeds=h).last_hidden_state
    got, (k, v) = ours(h, torch.arange(13).expand(2, 13))
    assert torch.allclose(got, ref, atol=1e-5, rtol=1e-4), (got - ref).abs().max()
    assert k.shape == v.shape == (2, 2, 13, 16)


@torch.no_grad()
def test_incremental_with_a_kv_cache_equals_the_whole_sequence():
    _, ours = _pair(1)
    h = torch.randn(1, 20, HIDDEN)
    pos = torch.arange(20)[None]
    full, _ = ours(h, pos)
    k_cache = v_cache = None
    outs = []
    for lo, hi in [(0, 7), (7, 8), (8, 11), (11, 20)]:  # a prompt chunk, then steps committing 1, 3, 9 tokens
        past = None if k_cache is None else (k_cache, v_cache)
        o, (k, v) = ours(h[:, lo:hi], pos[:, lo:hi], past)
        k_cache = k if k_cache is None else torch.cat([k_cache, k], dim=2)
        v_cache = v if v_cache is None else torch.cat([v_cache, v], dim=2)
        outs.append(o)
    assert torch.allclose(torch.cat(outs, dim=1), full, atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_batched_requests_with_different_context_lengths():
    """Two requests in one call: past slots beyond a request's own context are masked with ``valid``."""
    _, ours = _pair(2)
    h = torch.randn(2, 9, HIDDEN)
    pos = torch.arange(9)[None].expand(2, 9)
    full, (k, v) = ours(h, pos)
    # request 0 has 6 past tokens, request 1 has 4 (its slots 4, 5 hold junk); each feeds its next 2 tokens
    past_k, past_v = k[:, :, :6].clone(), v[:, :, :6].clone()
    past_k[1, :, 4:] = 99.0
    valid = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    new_h = torch.stack([h[0, 6:8], h[1, 4:6]])
    new_pos = torch.tensor([[6, 7], [4, 5]])
    got, _ = ours(new_h, new_pos, (past_k, past_v), valid)
    assert torch.allclose(got[0], full[0, 6:8], atol=1e-5, rtol=1e-4)
    assert torch.allclose(got[1], full[1, 4:6], atol=1e-5, rtol=1e-4)


def _prefix_heads(seed=0):
    from vllm_entmtp.heads.hydra import HydraHeads, HydraHeadsConfig

    torch.manual_seed(seed)
    shape = PrefixLayerConfig(num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96)
    heads = HydraHeads(HydraHeadsConfig(hidden_size=HIDDEN, vocab_size=50, hydra_num_heads=2,
                                        hydra_head_arch="prefix-mlp", prefix_layer=shape)).eval()
    for p in heads.prefix_embeding_layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return heads


@torch.no_grad()
def test_kv_cache_per_request_matches_the_whole_sequence_in_batches():
    """Two requests advance together with different numbers of new tokens per step (prompt chunks, accepted
    paths); each output equals the layer run over the request's whole sequence."""
    from vllm_entmtp.proposer import PrefixKVCache

    heads = _prefix_heads()
    seqs = {"a": torch.randn(17, HIDDEN), "b": torch.randn(12, HIDDEN)}
    full = {r: heads.prefix(h[None], torch.arange(len(h))[None])[0][0] for r, h in seqs.items()}
    cache = PrefixKVCache(heads)
    done = {"a": 0, "b": 0}
    for step in [{"a": 9, "b": 4}, {"a": 1, "b": 5}, {"a": 3, "b": 1}, {"a": 4, "b": 2}]:
        ids = list(step)
        out = cache.advance(ids, [seqs[r][done[r]:done[r] + n] for r, n in step.items()],
                            [torch.arange(done[r], done[r] + n) for r, n in step.items()])
        for i, (r, n) in enumerate(step.items()):
            done[r] += n
            assert torch.allclose(out[i], full[r][done[r] - 1], atol=1e-5), (r, done[r])
    assert len(cache) == 2 and cache.free_missing({"b"}) == 1 and cache.tracked_ids() == {"b"}


@torch.no_grad()
def test_kv_cache_recomputed_request_starts_over():
    """After preemption vLLM recomputes a request from its first uncached token: the cache is cut there."""
    from vllm_entmtp.proposer import PrefixKVCache

    heads = _prefix_heads(1)
    h = torch.randn(10, HIDDEN)
    full = heads.prefix(h[None], torch.arange(10)[None])[0][0]
    cache = PrefixKVCache(heads)
    cache.advance(["r"], [h[:8]], [torch.arange(8)])
    out = cache.advance(["r"], [h[:10]], [torch.arange(10)])  # recomputed from position 0
    assert torch.allclose(out[0], full[9], atol=1e-5)
    out = cache.advance(["r"], [h[5:7]], [torch.arange(5, 7)])  # recomputed from position 5
    assert torch.allclose(out[0], full[6], atol=1e-5)
    with pytest.raises(ValueError, match="at least one new token"):
        cache.advance(["r"], [h[:0]], [torch.arange(0)])


def test_runner_feeds_the_prefix_cache_the_committed_rows():
    """Which rows of a step's hidden states reach the prefix-layer cache, per kind of request: a prompt chunk
    that does not end the prompt, the last chunk of a prompt, a chain with 2 of 3 draft tokens accepted, and a
    tree whose accepted path is nodes 2 then 5."""
    from types import SimpleNamespace

    from vllm_entmtp.step import STEP, prefix_layer_hidden

    got = {}

    class Cache:
        def advance(self, req_ids, blocks, positions):
            got.update({r: (b[:, 0].long().tolist(), p.tolist()) for r, b, p in zip(req_ids, blocks, positions)})
            return torch.zeros(len(req_ids), 1)

    # rows: chunk 0..4 | last chunk 5..7 | chain root 8 + drafts 9..11 | tree root 12 + nodes 13..18
    qsl = np.array([0, 5, 8, 12, 19])
    positions = torch.tensor([0, 1, 2, 3, 4, 20, 21, 22, 40, 41, 42, 43, 60, 61, 61, 62, 62, 62, 63])
    runner = SimpleNamespace(query_start_loc=SimpleNamespace(np=qsl), positions=positions,
                             input_batch=SimpleNamespace(req_ids=["chunk", "last", "chain", "tree"]),
                             drafter=SimpleNamespace(prefix_cache=Cache()))
    hidden = torch.arange(19, dtype=torch.float32)[:, None].expand(19, 4)  # row i holds i
    sampled = [[], [7], [1, 2, 3], [4, 5, 6]]
    meta = SimpleNamespace(num_draft_tokens=[0, 0, 3, 6])
    STEP.reset({})
    STEP.paths[3] = [2, 5]
    prefix_layer_hidden(runner, hidden, sampled, meta)
    STEP.reset({})
    assert got["chunk"] == ([0, 1, 2, 3, 4], [0, 1, 2, 3, 4])
    assert got["last"] == ([5, 6, 7], [20, 21, 22])
    assert got["chain"] == ([8, 9, 10], [40, 41, 42])
    assert got["tree"] == ([12, 14, 17], [60, 61, 62])
