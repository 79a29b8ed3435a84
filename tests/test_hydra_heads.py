"""Hydra heads: zankner/Hydra's checkpoint layout read strictly and reproduced exactly, this project's layout
(with a draft vocabulary) round-tripped, and conversions between them with `vllm-entmtp convert-heads`."""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from conftest import write_public_checkpoint
from vllm_entmtp.cli import main as cli_main
from vllm_entmtp.errors import HeadsCheckpointError
from vllm_entmtp.heads.formats import detect_layout, load_any_heads, read_any_heads_config
from vllm_entmtp.heads.hydra import HydraHeads, HydraHeadsConfig

H, V, HEADS, LAYERS = 16, 50, 3, 2


class _RefResBlock(nn.Module):
    """zankner/Hydra's ResBlock: ``res_connection(x) + SiLU(linear(x))``."""

    def __init__(self, hidden, num_condition=0):
        super().__init__()
        self.linear = nn.Linear(hidden * (num_condition + 1), hidden)
        self.res_connection = (nn.Linear(hidden * (num_condition + 1), hidden) if num_condition > 0
                               else nn.Identity())

    def forward(self, x):
        return self.res_connection(x) + nn.functional.silu(self.linear(x))


class _RefHydraMLP(nn.Module):
    """The head module zankner/Hydra's ``HydraMLP`` builds for grounded heads (one ResBlock repeated for the
    extra layers, as there), with a full-vocabulary ``hydra_lm_head`` with bias per head."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.hydra_mlp = nn.ModuleList(
            nn.Sequential(_RefResBlock(H, k + 1), *([_RefResBlock(H)] * (LAYERS - 1))) for k in range(HEADS))
        self.hydra_lm_head = nn.ModuleList(nn.Linear(H, V) for _ in range(HEADS))
        for p in self.parameters():
            nn.init.normal_(p, std=0.3)

    def logits(self, k, h, path_emb):
        return self.hydra_lm_head[k](self.hydra_mlp[k](torch.cat([h, path_emb[:, :k + 1].flatten(1)], -1)))


def _write_hydra(path: Path, state, fmt="pt", **config):
    cfg = {"hydra_num_heads": HEADS, "hydra_num_layers": LAYERS, "hydra_head_arch": "mlp", "grounded_heads": True,
           "base_model_name_or_path": "lmsys/vicuna-7b-v1.3", **config}
    return write_public_checkpoint(path, cfg, state, "hydra_lm_head", fmt)


def _inputs(n=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, H, generator=g), torch.randn(n, HEADS, H, generator=g)


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_hydra_layout_reproduces_the_reference_heads(tmp_path, fmt):
    ref = _RefHydraMLP()
    _write_hydra(tmp_path / "h", ref.state_dict(), fmt=fmt)
    assert detect_layout(tmp_path / "h") == "hydra"
    cfg = read_any_heads_config(tmp_path / "h")
    assert (cfg.hidden_size, cfg.vocab_size, cfg.num_heads) == (H, V, HEADS)  # sizes from the weights
    heads = load_any_heads(tmp_path / "h", hidden_size=H, vocab_size=V)
    assert isinstance(heads, HydraHeads) and heads.hydra_lm_head is not None
    h, emb = _inputs()
    with torch.no_grad():
        for k in range(HEADS):
            ours = heads.logits(k, heads.hidden_states(k, h, emb), None)
            assert torch.allclose(ours, ref.logits(k, h, emb), atol=1e-5)


def _break(state, how):
    state = dict(state)
    if how == "renamed":
        state["hydra_mlp.0.0.lin.weight"] = state.pop("hydra_mlp.0.0.linear.weight")
    elif how == "missing_head":
        state = {k: v for k, v in state.items() if not k.startswith(("hydra_mlp.2.", "hydra_lm_head.2."))}
    elif how == "extra":
        state["prefix_embeding_layer.layers.0.mlp.up_proj.weight"] = torch.zeros(4, H)
    elif how == "shape":
        state["hydra_mlp.1.0.res_connection.weight"] = torch.zeros(H, 2 * H)
    return state


@pytest.mark.parametrize("how, names", [
    ("renamed", ["hydra_mlp.0.0.linear.weight", "hydra_mlp.0.0.lin.weight"]),
    ("missing_head", ["hydra_mlp.2.0.linear.weight", "hydra_lm_head.2.bias"]),
    ("extra", ["prefix_embeding_layer.layers.0.mlp.up_proj.weight"]),
    ("shape", ["hydra_mlp.1.0.res_connection.weight", "(16, 32)", "(16, 48)"]),
])
def test_mis_keyed_hydra_checkpoints_fail_with_the_names(tmp_path, how, names):
    _write_hydra(tmp_path / "h", _break(_RefHydraMLP().state_dict(), how))
    with pytest.raises(HeadsCheckpointError) as e:
        load_any_heads(tmp_path / "h")
    for name in names:
        assert name in str(e.value)
    with pytest.raises(HeadsCheckpointError):  # the start-up check refuses it too, without loading tensors
        read_any_heads_config(tmp_path / "h")


def test_config_with_more_heads_than_weights_and_cross_attn_are_refused(tmp_path):
    _write_hydra(tmp_path / "a", _RefHydraMLP().state_dict(), hydra_num_heads=4)
    with pytest.raises(HeadsCheckpointError, match=r"hydra_mlp\.3\.0\.linear\.weight"):
        read_any_heads_config(tmp_path / "a")
    _write_hydra(tmp_path / "b", _RefHydraMLP().state_dict(), hydra_head_arch="cross-attn")
    with pytest.raises(HeadsCheckpointError, match="'cross-attn' is not supported"):
        load_any_heads(tmp_path / "b")


def _ref_prefix_mlp(tmp_path: Path):
    """Hydra++ ``prefix-mlp`` reference: a one-layer Hugging Face ``LlamaModel`` (with its unused embed_tokens)
    under ``prefix_embeding_layer`` next to the MLP heads, and the base model's config in a folder."""
    from transformers import LlamaConfig, LlamaModel

    base = tmp_path / "base"
    base.mkdir()
    llama = LlamaConfig(hidden_size=H, intermediate_size=24, num_attention_heads=4, num_key_value_heads=2,
                        num_hidden_layers=1, vocab_size=V, rope_parameters={"rope_type": "default",
                                                                             "rope_theta": 500.0})
    (base / "config.json").write_text(llama.to_json_string())
    torch.manual_seed(3)
    prefix = LlamaModel(llama).eval()
    for p in prefix.parameters():
        nn.init.normal_(p, std=0.3)
    heads = _RefHydraMLP()
    state = {**heads.state_dict(), **{f"prefix_embeding_layer.{k}": v for k, v in prefix.state_dict().items()}}
    return heads, prefix, state, base


def test_prefix_mlp_heads_in_hydras_layout_reproduce_the_reference(tmp_path):
    ref_heads, ref_prefix, state, base = _ref_prefix_mlp(tmp_path)
    _write_hydra(tmp_path / "h", state, hydra_head_arch="prefix-mlp", base_model_name_or_path=str(base))
    heads = load_any_heads(tmp_path / "h", hidden_size=H, vocab_size=V)
    assert heads.config.hydra_head_arch == "prefix-mlp" and heads.config.prefix_layer.rope_theta == 500.0
    g = torch.Generator().manual_seed(4)
    seq, emb = torch.randn(1, 9, H, generator=g), torch.randn(1, HEADS, H, generator=g)
    with torch.no_grad():
        p_ref = ref_prefix(inputs_embeds=seq).last_hidden_state[:, -1]
        p, _ = heads.prefix(seq, torch.arange(9)[None])
        assert torch.allclose(p[:, -1], p_ref, atol=1e-5)
        for k in range(HEADS):
            assert torch.allclose(heads.logits(k, heads.hidden_states(k, p[:, -1], emb), None),
                                  ref_heads.logits(k, p_ref, emb), atol=1e-4)
    # round trip through this project's layout and back
    assert cli_main(["convert-heads", str(tmp_path / "h"), str(tmp_path / "ours"), "--to", "entmtp-hydra"]) == 0
    assert cli_main(["convert-heads", str(tmp_path / "ours"), str(tmp_path / "back"), "--to", "hydra"]) == 0
    again = load_any_heads(tmp_path / "back")
    for k, v in heads.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k


def test_prefix_mlp_without_the_base_models_shape_or_with_a_missing_weight_is_refused(tmp_path):
    _, _, state, base = _ref_prefix_mlp(tmp_path)
    _write_hydra(tmp_path / "a", state, hydra_head_arch="prefix-mlp", base_model_name_or_path="lmsys/vicuna-7b")
    with pytest.raises(HeadsCheckpointError, match="base_model_name_or_path='lmsys/vicuna-7b' is not a local"):
        load_any_heads(tmp_path / "a")
    state = {k: v for k, v in state.items() if "o_proj" not in k}
    _write_hydra(tmp_path / "b", state, hydra_head_arch="prefix-mlp", base_model_name_or_path=str(base))
    with pytest.raises(HeadsCheckpointError, match=r"prefix_embeding_layer\.layers\.0\.self_attn\.o_proj\.weight"):
        read_any_heads_config(tmp_path / "b")


def _ours(truncated=None, seed=0):
    torch.manual_seed(seed)
    heads = HydraHeads(HydraHeadsConfig(hidden_size=H, vocab_size=V, hydra_num_heads=HEADS, hydra_num_layers=LAYERS,
                                        truncated_vocab_size=truncated))
    for name, p in heads.named_parameters():
        nn.init.normal_(p, std=0.3)
    if truncated:
        heads.token_map.copy_(torch.randperm(V)[:truncated].sort().values)
    return heads


def _target(path: Path, w: torch.Tensor) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"tie_word_embeddings": True, "hidden_size": H, "vocab_size": V}))
    save_file({"model.embed_tokens.weight": w.contiguous()}, str(path / "model.safetensors"))
    return path


def _top_tokens(heads, w, h, emb, k):
    with torch.no_grad():
        wd = heads.draft_lm_weight(w)
        return [heads.to_token_ids(heads.logits(j, heads.hidden_states(j, h, emb), wd).topk(k).indices)
                for j in range(HEADS)]


def test_own_layout_round_trip_keeps_the_draft_vocabulary(tmp_path):
    heads = _ours(truncated=20)
    heads.save(tmp_path / "ours")
    assert detect_layout(tmp_path / "ours") == "entmtp-hydra"
    back = load_any_heads(tmp_path / "ours", hidden_size=H, vocab_size=V)
    assert torch.equal(back.token_map, heads.token_map) and back.token_map.dtype == torch.long
    w = torch.randn(V, H)
    h, emb = _inputs()
    for a, b in zip(_top_tokens(heads, w, h, emb, 5), _top_tokens(back, w, h, emb, 5)):
        assert torch.equal(a, b)
    with pytest.raises(HeadsCheckpointError, match="vocab_size=50.*vocab_size=51"):
        load_any_heads(tmp_path / "ours", vocab_size=V + 1)


def test_convert_to_hydra_layout_and_back_keeps_the_proposals(tmp_path, capsys):
    heads = _ours(truncated=20)
    heads.save(tmp_path / "ours")
    w = torch.randn(V, H)
    target = _target(tmp_path / "target", w)
    with pytest.raises(SystemExit, match="--target-model"):
        cli_main(["convert-heads", str(tmp_path / "ours"), str(tmp_path / "x"), "--to", "hydra"])
    assert cli_main(["convert-heads", str(tmp_path / "ours"), str(tmp_path / "hy"), "--to", "hydra",
                     "--target-model", str(target)]) == 0
    assert "copied the target's lm_head" in capsys.readouterr().out
    assert detect_layout(tmp_path / "hy") == "hydra"
    assert cli_main(["convert-heads", str(tmp_path / "hy"), str(tmp_path / "back"), "--to", "entmtp-hydra"]) == 0
    h, emb = _inputs(n=20)
    want = _top_tokens(heads, w, h, emb, 5)
    for name in ("hy", "back"):
        got = load_any_heads(tmp_path / name)
        assert got.token_map is None and got.hydra_lm_head is not None  # full-vocabulary lm_heads now
        for a, b in zip(want, _top_tokens(got, w, h, emb, 5)):
            assert torch.equal(a, b), name  # same top-5 tokens: none outside the old draft vocabulary


def test_heads_keep_their_kind(tmp_path):
    from conftest import make_heads

    make_heads(tmp_path / "medusa", hidden_size=H, vocab_size=V, num_heads=HEADS)
    medusa_dir = tmp_path / "medusa"
    with pytest.raises(SystemExit, match="Hydra heads, not MedusaHeads"):
        cli_main(["convert-heads", str(medusa_dir), str(tmp_path / "x"), "--to", "entmtp-hydra"])
    _ours().save(tmp_path / "ours")
    with pytest.raises(SystemExit, match="Medusa heads, not HydraHeads"):
        cli_main(["convert-heads", str(tmp_path / "ours"), str(tmp_path / "y"), "--to", "vllm"])
