"""Loading MTP heads: round trip, and clear errors for checkpoints that do not fit."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import make_heads
from vllm_entmtp.errors import HeadsCheckpointError
from vllm_entmtp.heads.medusa import load_heads


def test_round_trip_keeps_weights_and_outputs(tmp_path):
    heads = make_heads(tmp_path, hidden_size=32, vocab_size=50, num_heads=3, num_layers=2)
    loaded = load_heads(tmp_path, hidden_size=32, vocab_size=50)
    x = torch.randn(5, 32)
    w = torch.randn(50, 32)
    assert loaded.num_heads == 3
    torch.testing.assert_close(loaded.logits(x, w), heads.logits(x, w))
    assert heads.logits(x, w).shape == (3, 5, 50)
    # vLLM's Medusa weight names
    assert set(load_file(tmp_path / "model.safetensors")) == {
        f"blocks.{h}.layers.{l}.{p}" for h in range(3) for l in range(2) for p in ("weight", "bias")}


def test_untrained_heads_are_identity(tmp_path):
    from vllm_entmtp.heads.medusa import MedusaHeads, MedusaHeadsConfig

    heads = MedusaHeads(MedusaHeadsConfig(hidden_size=8, vocab_size=10, num_heads=2))
    x = torch.randn(4, 8)
    torch.testing.assert_close(heads(x), torch.stack([x, x]))


def test_wrong_hidden_size_is_refused(tmp_path):
    make_heads(tmp_path, hidden_size=32, vocab_size=50)
    with pytest.raises(HeadsCheckpointError, match=r"hidden_size=32.*target model has hidden_size=576"):
        load_heads(tmp_path, hidden_size=576, vocab_size=50)


def test_wrong_vocab_is_refused(tmp_path):
    make_heads(tmp_path, hidden_size=32, vocab_size=50)
    with pytest.raises(HeadsCheckpointError, match=r"vocab_size=50.*target model has vocab_size=49152"):
        load_heads(tmp_path, hidden_size=32, vocab_size=49152)


def test_missing_and_unexpected_weights_are_named(tmp_path):
    make_heads(tmp_path, hidden_size=16, vocab_size=20, num_heads=2)
    state = load_file(tmp_path / "model.safetensors")
    state["extra.weight"] = state.pop("blocks.1.layers.0.weight")
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(HeadsCheckpointError) as e:
        load_heads(tmp_path)
    assert "blocks.1.layers.0.weight" in str(e.value) and "extra.weight" in str(e.value)


def test_more_heads_in_config_than_in_weights_is_refused(tmp_path):
    make_heads(tmp_path, hidden_size=16, vocab_size=20, num_heads=2)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["num_heads"] = 3
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HeadsCheckpointError, match=r"missing weights \['blocks.2.layers.0.bias'"):
        load_heads(tmp_path)


def test_wrong_shape_is_refused(tmp_path):
    make_heads(tmp_path, hidden_size=16, vocab_size=20, num_heads=1)
    state = load_file(tmp_path / "model.safetensors")
    state["blocks.0.layers.0.weight"] = torch.zeros(16, 8)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(HeadsCheckpointError, match=r"blocks.0.layers.0.weight has shape \(16, 8\)"):
        load_heads(tmp_path)


@pytest.mark.parametrize("content, match", [
    (None, "no config.json"),
    ("{not json", "invalid JSON"),
    ('{"model_type": "llama"}', "model_type is 'llama'"),
    ('{"model_type": "medusa", "hidden_size": 8, "vocab_size": 10, "num_heads": 0}', "num_heads"),
])
def test_bad_config_is_refused(tmp_path, content, match):
    if content is not None:
        (tmp_path / "config.json").write_text(content)
    with pytest.raises(HeadsCheckpointError, match=match):
        load_heads(tmp_path)
