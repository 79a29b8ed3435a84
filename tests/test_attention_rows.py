"""benchmarks/attention_rows.py: its options, the target's attention shape and a step's layout (the timing itself is a
benchmark's)."""
import pytest
from conftest import load_benchmark

ar = load_benchmark("attention_rows")


def test_counts_name_the_option_they_came_from():
    assert ar.parse_counts("1-3,8", "rows") == [1, 2, 3, 8]
    assert ar.parse_counts("1000, 250", "contexts") == [250, 1000]
    with pytest.raises(ValueError, match="^--contexts: "):
        ar.parse_counts("0", "contexts")
    with pytest.raises(ValueError, match="^--requests: "):
        ar.parse_counts("x", "requests")


def test_attention_shape_reads_grouped_and_plain_heads():
    smol = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 30}
    assert ar.attention_shape(smol) == (9, 3, 64, 30)
    mha = {"hidden_size": 64, "num_attention_heads": 4, "head_dim": 32, "num_hidden_layers": 2}
    assert ar.attention_shape(mha) == (4, 4, 32, 2)


def test_a_step_layout_gives_each_request_its_rows_and_its_own_blocks():
    lay = ar.batch_layout(requests=3, rows=2, context=250, block_size=128)
    assert lay["query_start_loc"] == [0, 2, 4, 6]
    assert lay["seq_lens"] == [252, 252, 252]  # the rows' own K/V follow the context
    assert lay["block_table"] == [[0, 1], [2, 3], [4, 5]]  # ceil(252 / 128) blocks each, none shared
    assert lay["num_blocks"] == 6
    assert ar.batch_layout(1, 3, 126, 128)["block_table"] == [[0, 1]]  # 129 tokens spill into a second block
    with pytest.raises(ValueError):
        ar.batch_layout(0, 1, 10, 128)


def test_extra_row_cost_is_the_mean_over_each_requests_added_rows():
    extra = ar.extra_row_ms({1: 10.0, 2: 18.0, 4: 22.0}, requests=16)
    assert extra[1] is None
    assert extra[2] == pytest.approx(0.5)  # 8 ms over 16 second rows
    assert extra[4] == pytest.approx(12.0 / 48)  # 12 ms over 16 x 3 added rows
    assert ar.extra_row_ms({2: 18.0, 4: 22.0}, requests=16) == {2: None, 4: None}  # one row not timed


def test_bad_options_are_refused_before_anything_is_timed(capsys):
    for argv in (["--block-size", "0"], ["--repeats", "0"], ["--contexts", "0"]):
        with pytest.raises(SystemExit):
            ar.main(argv)
        assert argv[0] in capsys.readouterr().err
