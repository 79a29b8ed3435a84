"""Checkpoint layouts of MTP heads: detection, strict reading, writing, and `vllm-entmtp convert-heads`; the
`vllm-entmtp` command's own options and help texts."""
import argparse
import importlib
import importlib.metadata
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from conftest import make_heads, write_public_checkpoint
from vllm_entmtp.cli import COMMANDS
from vllm_entmtp.cli import main as cli_main
from vllm_entmtp.errors import HeadsCheckpointError
from vllm_entmtp.heads.formats import (LAYOUTS, detect_layout, load_any_heads, read_any_heads_config,
                                       save_heads)
from vllm_entmtp.heads.medusa import MedusaHeads, MedusaHeadsConfig

H, V, HEADS, LAYERS = 16, 50, 3, 2


class _RefResBlock(nn.Module):
    """FasterDecoding's ResBlock structure: ``x + SiLU(linear(x))``, the weights under ``linear``."""

    def __init__(self, hidden):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)

    def forward(self, x):
        return x + nn.functional.silu(self.linear(x))


def _reference_heads(seed=0, num_heads=HEADS, num_layers=LAYERS):
    """``medusa_head`` as FasterDecoding's MedusaModel builds it: one ResBlock repeated ``num_layers`` times
    (shared weights), then a per-head Linear(hidden, vocab, bias=False)."""
    torch.manual_seed(seed)
    heads = nn.ModuleList(nn.Sequential(*([_RefResBlock(H)] * num_layers), nn.Linear(H, V, bias=False))
                          for _ in range(num_heads))
    for p in heads.parameters():
        nn.init.normal_(p, std=0.3)
    return heads


def _write_fd(path: Path, state, *, num_heads=HEADS, num_layers=LAYERS, fmt="pt", **config):
    cfg = {"medusa_num_heads": num_heads, "medusa_num_layers": num_layers,
           "base_model_name_or_path": "some/base", **config}
    return write_public_checkpoint(path, cfg, state, "medusa_lm_head", fmt)


def _fd_checkpoint(path: Path, fmt="pt", **kw):
    ref = _reference_heads()
    _write_fd(path, ref.state_dict(), fmt=fmt, **kw)
    return ref


def _fake_target(path: Path, weight: torch.Tensor) -> Path:
    """A transformers-like model folder with tied embeddings (like SmolLM2): only the embedding matters here."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "tie_word_embeddings": True,
                                                  "hidden_size": H, "vocab_size": V}))
    save_file({"model.embed_tokens.weight": weight.to(torch.bfloat16).float(),
               "model.norm.weight": torch.ones(H)}, str(path / "model.safetensors"))
    return path


def _convert(*argv):
    return cli_main(["convert-heads", *map(str, argv)])


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_fasterdecoding_checkpoint_gives_reference_logits(tmp_path, fmt):
    ref = _fd_checkpoint(tmp_path, fmt=fmt)  # config without hidden_size / vocab_size: read from the weights
    assert detect_layout(tmp_path) == "fasterdecoding"
    cfg = read_any_heads_config(tmp_path)
    assert (cfg.hidden_size, cfg.vocab_size, cfg.num_heads, cfg.num_hidden_layers) == (H, V, HEADS, LAYERS)
    assert not cfg.original_lm_head and cfg.medusa_fc_bias
    heads = load_any_heads(tmp_path, hidden_size=H, vocab_size=V)
    x = torch.randn(7, H)
    with torch.no_grad():
        want = torch.stack([head(x) for head in ref])
        torch.testing.assert_close(heads.logits(x), want)


def test_per_head_round_trip_is_exact(tmp_path):
    _fd_checkpoint(tmp_path / "fd")
    src = load_any_heads(tmp_path / "fd")
    save_heads(src, tmp_path / "vllm", "vllm")
    assert detect_layout(tmp_path / "vllm") == "vllm"
    save_heads(load_any_heads(tmp_path / "vllm"), tmp_path / "fd2", "fasterdecoding")
    back = load_any_heads(tmp_path / "fd2")
    assert back.state_dict().keys() == src.state_dict().keys()
    assert all(torch.equal(back.state_dict()[k], v) for k, v in src.state_dict().items())
    assert json.loads((tmp_path / "fd2" / "config.json").read_text())["base_model_name_or_path"] == "some/base"
    assert "medusa_num_heads" not in json.loads((tmp_path / "vllm" / "config.json").read_text())


def test_shared_lm_head_round_trip_through_cli(tmp_path, capsys):
    """vllm (shared lm_head) -> fasterdecoding (needs the target's lm_head) -> vllm: the same logits."""
    shared = make_heads(tmp_path / "src", hidden_size=H, vocab_size=V, num_heads=HEADS, num_layers=LAYERS)
    w = torch.randn(V, H).to(torch.bfloat16).float()  # the target stores bfloat16, like SmolLM2
    target = _fake_target(tmp_path / "target", w)

    with pytest.raises(SystemExit) as e:
        _convert(tmp_path / "src", tmp_path / "fd", "--to", "fasterdecoding")
    assert "--target-model" in str(e.value.code) and "original_lm_head" in str(e.value.code)
    assert not (tmp_path / "fd").exists()

    assert _convert(tmp_path / "src", tmp_path / "fd", "--to", "fasterdecoding", "--target-model", target) == 0
    out = capsys.readouterr().out
    assert "vllm layout: 3 heads x 2 layers" in out and "fasterdecoding layout: 3 heads x 2 layers" in out
    assert "model.embed_tokens.weight" in out and "medusa_lm_head.pt" in out
    assert "different weights" in out  # FasterDecoding's own code ties a head's layers: said, not hidden
    assert _convert(tmp_path / "fd", tmp_path / "back", "--to", "vllm") == 0

    x = torch.randn(5, H)
    want = shared.logits(x, w)
    for d in ("fd", "back"):
        got = load_any_heads(tmp_path / d, hidden_size=H, vocab_size=V)
        assert all(torch.equal(lm.weight, w) for lm in got.lm_heads)  # bit-exact copies of the target's lm_head
        assert all(torch.equal(got.state_dict()[k], v) for k, v in shared.state_dict().items())
        torch.testing.assert_close(got.logits(x), want)  # per-head vs stacked matmul: rounding only
    assert read_any_heads_config(tmp_path / "back").original_lm_head is False


def test_heads_without_bias_get_zero_biases(tmp_path):
    heads = MedusaHeads(MedusaHeadsConfig(hidden_size=H, vocab_size=V, num_heads=2, medusa_fc_bias=False,
                                          original_lm_head=False))
    for p in heads.parameters():
        nn.init.normal_(p, std=0.3)
    save_heads(heads, tmp_path, "fasterdecoding")
    back = load_any_heads(tmp_path)
    x = torch.randn(4, H)
    torch.testing.assert_close(back.logits(x), heads.logits(x), rtol=0, atol=0)


def test_cli_subprocess(tmp_path):
    _fd_checkpoint(tmp_path / "fd")
    r = subprocess.run([sys.executable, "-m", "vllm_entmtp.cli", "convert-heads", str(tmp_path / "fd"),
                        str(tmp_path / "out"), "--to", "vllm"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "fasterdecoding layout: 3 heads x 2 layers, hidden 16, vocab 50, own lm_head per head" in r.stdout
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "model.safetensors"]


def test_cli_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"vllm-entmtp {importlib.metadata.version('vllm-entmtp')}\n"


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_cli_help_is_plain_text(command, capsys):
    with pytest.raises(SystemExit) as e:
        cli_main([command, "--help"] if command else ["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "usage: vllm-entmtp" in out
    assert "``" not in out and not re.search(r":[a-z]+:`", out), out  # no reST markup


def _parser_of(command: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    importlib.import_module(COMMANDS[command][0]).add_arguments(p)
    return p


def test_cli_one_line_helps_say_what_the_commands_default_to_and_support():
    assert f"{_parser_of('build-trees').get_default('signal')} by default" in COMMANDS["build-trees"][1]
    kinds = next(a.choices for a in _parser_of("train-heads")._actions if a.dest == "kind")
    assert all(k in COMMANDS["train-heads"][1].lower() for k in kinds)


def test_destination_must_be_empty(tmp_path):
    _fd_checkpoint(tmp_path / "fd")
    with pytest.raises(SystemExit, match="not an empty folder"):
        _convert(tmp_path / "fd", tmp_path / "fd", "--to", "vllm")


def _rename(state, old, new):
    state[new] = state.pop(old)


@pytest.mark.parametrize("edit, config, names", [
    (lambda s: _rename(s, "1.0.linear.weight", "1.0.linear.weights"), {}, ["1.0.linear.weight",
                                                                           "1.0.linear.weights"]),
    (lambda s: [s.pop(k) for k in list(s) if k.startswith("2.")], {}, ["2.0.linear.bias", "2.2.weight"]),
    (lambda s: s.update({"3.0.linear.weight": torch.zeros(H, H)}), {}, ["3.0.linear.weight"]),
    (lambda s: s.update({"0.1.linear.bias": torch.zeros(H + 1)}), {}, ["0.1.linear.bias", f"({H + 1},)"]),
    (lambda s: s.update({"0.2.weight": torch.zeros(V)}), {}, ["0.2.weight", f"({V},)"]),
    (lambda s: s.update({"1.2.weight": torch.zeros(V, H + 1)}), {}, ["1.2.weight", f"({V}, {H + 1})"]),
    (lambda s: None, {"medusa_num_heads": 5}, ["3.0.linear.weight", "4.2.weight", "medusa_num_heads=5"]),
    (lambda s: None, {"medusa_num_layers": 1}, ["0.1.linear.weight", "2.2.weight"]),
])
def test_mis_keyed_fasterdecoding_checkpoint_names_the_keys(tmp_path, edit, config, names):
    state = {k: v.clone() for k, v in _reference_heads().state_dict().items()}
    edit(state)
    _write_fd(tmp_path, state, **config)
    for read in (read_any_heads_config, load_any_heads):
        with pytest.raises(HeadsCheckpointError) as e:
            read(tmp_path)
        for name in names:
            assert name in str(e.value)


def test_mis_keyed_vllm_checkpoint_names_the_keys(tmp_path):
    from safetensors.torch import load_file

    make_heads(tmp_path, hidden_size=H, vocab_size=V, num_heads=HEADS, num_layers=LAYERS)
    state = load_file(tmp_path / "model.safetensors")
    _rename(state, "blocks.1.layers.1.bias", "blocks.1.layer.1.bias")
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(HeadsCheckpointError, match=r"blocks\.1\.layers\.1\.bias.*blocks\.1\.layer\.1\.bias"):
        load_any_heads(tmp_path)


def test_truncated_draft_vocabulary_is_refused(tmp_path):
    make_heads(tmp_path, hidden_size=H, vocab_size=V, num_heads=1)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "truncated_vocab_size": 10}))
    with pytest.raises(HeadsCheckpointError, match="truncated_vocab_size=10 < vocab_size=50"):
        read_any_heads_config(tmp_path)


def test_config_sizes_contradicting_weights_are_refused(tmp_path):
    _fd_checkpoint(tmp_path, hidden_size=32)
    with pytest.raises(HeadsCheckpointError, match=r"says hidden_size=32, but the weights .* hidden_size=16"):
        read_any_heads_config(tmp_path)


def test_fasterdecoding_heads_that_do_not_fit_the_target(tmp_path):
    _fd_checkpoint(tmp_path)
    with pytest.raises(HeadsCheckpointError, match=r"vocab_size=50, but the target model has vocab_size=49152"):
        load_any_heads(tmp_path, hidden_size=H, vocab_size=49152)


def test_unknown_folder_lists_files_and_layouts(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(HeadsCheckpointError) as e:
        detect_layout(tmp_path)
    msg = str(e.value)
    assert "unknown layout" in msg and "config.json" in msg and "pytorch_model.bin" in msg
    assert all(name in msg for name in LAYOUTS)
    (tmp_path / "empty").mkdir()
    with pytest.raises(HeadsCheckpointError, match="files found: none"):
        load_any_heads(tmp_path / "empty")
    with pytest.raises(HeadsCheckpointError, match="not a folder"):
        read_any_heads_config(tmp_path / "missing")
    crowded = tmp_path / "crowded"  # a folder of many files (a whole model, say): the message stays short
    crowded.mkdir()
    for i in range(500):
        (crowded / f"shard-{i:04d}.bin").write_bytes(b"")
    with pytest.raises(HeadsCheckpointError, match=r"shard-0000\.bin.*\.\.\. and 488 more") as e:
        detect_layout(crowded)
    assert len(str(e.value)) < 1500


def test_unreadable_fasterdecoding_files(tmp_path):
    _fd_checkpoint(tmp_path / "both")
    save_file({"x": torch.zeros(1)}, str(tmp_path / "both" / "medusa_lm_head.safetensors"))
    with pytest.raises(HeadsCheckpointError, match="both of medusa_lm_head.pt and medusa_lm_head.safetensors"):
        load_any_heads(tmp_path / "both")
    _write_fd(tmp_path / "pickled", nn.Linear(2, 2))  # a pickled module, not a state dict: weights_only refuses
    with pytest.raises(HeadsCheckpointError, match="weights_only=True"):
        read_any_heads_config(tmp_path / "pickled")
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text('{"medusa_num_heads": 2}')
    with pytest.raises(HeadsCheckpointError, match="neither of medusa_lm_head.pt"):
        load_any_heads(tmp_path / "noweights")
    (tmp_path / "badjson").mkdir()
    (tmp_path / "badjson" / "config.json").write_text("{medusa")
    with pytest.raises(HeadsCheckpointError, match="invalid JSON"):
        detect_layout(tmp_path / "badjson")


def test_start_up_check_reads_fasterdecoding_heads(tmp_path):
    """The entmtp config patch checks any layout against the target's sizes."""
    from types import SimpleNamespace

    from vllm_entmtp.patches.config import _check_heads_fit

    _fd_checkpoint(tmp_path)
    fits = SimpleNamespace(model="t", hf_config=SimpleNamespace(hidden_size=H, vocab_size=V))
    assert _check_heads_fit(tmp_path, fits).num_heads == HEADS
    other = SimpleNamespace(model="t", hf_config=SimpleNamespace(hidden_size=H, vocab_size=V + 1))
    with pytest.raises(HeadsCheckpointError, match="heads vocab_size=50, target vocab_size=51"):
        _check_heads_fit(tmp_path, other)


def test_entmtp_speculative_config_takes_fasterdecoding_heads(tmp_path, target_model_config):
    """A FasterDecoding folder as downloaded (no hidden_size in its config) passes vLLM's start-up, and the
    draft config gets the heads' hidden size (vLLM's MedusaConfig would default to 4096)."""
    import vllm.plugins
    from vllm.config import ParallelConfig, SpeculativeConfig

    vllm.plugins.load_general_plugins()
    h, v = 576, 49152  # the default target's sizes
    state = {"0.0.linear.weight": torch.zeros(h, h, dtype=torch.float16),
             "0.0.linear.bias": torch.zeros(h, dtype=torch.float16),
             "0.1.weight": torch.zeros(v, h, dtype=torch.float16)}
    _write_fd(tmp_path, state, num_heads=1, num_layers=1)
    sc = SpeculativeConfig(target_model_config=target_model_config, target_parallel_config=ParallelConfig(),
                           method="entmtp", model=str(tmp_path))
    assert sc.entmtp_heads == str(tmp_path) and sc.num_speculative_tokens == 1
    assert sc.draft_model_config.get_hidden_size() == h


def test_medusa_heads_for_vllms_own_medusa_method_carry_the_target_lm_head(tmp_path):
    """vLLM's medusa method never shares the target's lm_head: with original_lm_head it reads
    ``lm_heads.0.weight`` from the checkpoint (else the lm_head stays uninitialised and nothing is accepted)."""
    import json as _json

    from safetensors.torch import load_file, save_file

    from vllm_entmtp.heads.convert import for_vllm_medusa
    from vllm_entmtp.heads.medusa import MedusaHeads, MedusaHeadsConfig

    heads = MedusaHeads(MedusaHeadsConfig(hidden_size=8, vocab_size=20, num_heads=2, original_lm_head=True))
    heads.save(tmp_path / "ours")
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(_json.dumps({"tie_word_embeddings": True}))
    emb = torch.randn(20, 8)
    save_file({"model.embed_tokens.weight": emb}, str(target / "model.safetensors"))
    out = for_vllm_medusa(tmp_path / "ours", target, tmp_path / "vllm")
    state = load_file(str(out / "model.safetensors"))
    assert torch.equal(state["lm_heads.0.weight"], emb)
    assert set(state) - {"lm_heads.0.weight"} == set(load_file(str(tmp_path / "ours" / "model.safetensors")))
    assert _json.loads((out / "config.json").read_text())["original_lm_head"] is True
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    assert for_vllm_medusa(tmp_path / "ours", target, tmp_path / "vllm") == out  # up to date: kept
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime
    save_file({"model.embed_tokens.weight": torch.randn(21, 8)}, str(target / "model.safetensors"))
    (out / "entmtp-source.json").unlink()
    with pytest.raises(HeadsCheckpointError, match=r"lm_head is \(21, 8\)"):
        for_vllm_medusa(tmp_path / "ours", target, tmp_path / "vllm")
