"""benchmarks/gemm_rows.py: its row counts and the target's linear shapes (the timing itself is a benchmark's)."""
import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("gemm_rows", Path(__file__).parents[1] / "benchmarks" / "gemm_rows.py")
gr = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gr)


def test_rows_are_ranges_and_single_counts_sorted_once():
    assert gr.parse_rows("1-4,8,3, 16") == [1, 2, 3, 4, 8, 16]
    for bad in ("0-2", "4-2", "x", ",", "2-"):
        with pytest.raises(ValueError, match="--rows"):
            gr.parse_rows(bad)


def test_linear_shapes_follow_vllms_merged_llama_layers():
    smol = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3}
    assert gr.linear_shapes(smol) == [(576, 960), (576, 576), (576, 3072), (1536, 576)]
    mha = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "head_dim": 32}
    assert gr.linear_shapes(mha) == [(64, 384), (128, 64), (64, 256), (128, 64)]
