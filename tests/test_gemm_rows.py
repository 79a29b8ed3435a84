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


def test_median_ms_runs_each_count_once_untimed_then_every_pass_with_before_ahead_of_each_call():
    calls, befores = [], []
    ms = gr.median_ms(calls.append, [1, 4, 8], repeats=3, before=lambda: befores.append(len(calls)))
    assert sorted(ms) == [1, 4, 8] and all(v >= 0 for v in ms.values())
    assert calls[:3] == [1, 4, 8]  # first calls, before any timing
    assert sorted(calls[3:]) == [1] * 3 + [4] * 3 + [8] * 3
    assert befores == list(range(3, 12))  # once before each timed call, none before the first calls
