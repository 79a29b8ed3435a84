"""benchmarks/step_profile.py: the per-phase summary of recorded engine steps and its table."""
import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("step_profile", Path(__file__).parents[1] / "benchmarks" / "step_profile.py")
sp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sp)


def _rec(reqs, rows, spec, **ms):
    return {"reqs": reqs, "rows": rows, "spec": spec, **{k: v / 1000 for k, v in ms.items()}}


def test_summary_keeps_only_steps_where_every_request_decodes():
    recs = [_rec(1, 300, 0, step=900.0),            # a prefill: left out
            _rec(1, 1, 0, step=40.0, forward=30.0),
            _rec(1, 3, 2, step=60.0, forward=38.0, propose=5.0),
            _rec(1, 2, 1, step=50.0, forward=34.0, propose=4.0),
            _rec(2, 2, 0, step=70.0)]                # two requests: another concurrency
    s = sp.summarize(recs, 1)
    assert s["decode_steps"] == 3 and s["rows"] == 2.0
    assert s["median_ms"]["step"] == pytest.approx(50.0) and s["median_ms"]["forward"] == pytest.approx(34.0)
    assert s["median_ms"]["propose"] == pytest.approx(4.0)  # a step without the phase counts 0
    assert sp.summarize(recs, 2)["median_ms"]["step"] == pytest.approx(70.0)
    with pytest.raises(ValueError, match="exactly 4"):
        sp.summarize(recs, 4)


def test_summary_splits_steps_by_verified_drafts_and_whether_the_heads_ran():
    recs = [_rec(1, 1, 0, step=40.0),                     # nothing verified, the heads idle
            _rec(1, 1, 0, step=42.0),
            _rec(1, 1, 0, step=45.0, heads=1.0),           # nothing verified, the heads drafted for the next step
            _rec(1, 3, 2, step=55.0, heads=1.2),
            _rec(1, 3, 2, step=51.0)]                      # verified, then rested
    kinds = sp.summarize(recs, 1)["by_kind"]
    assert {k: v["steps"] for k, v in kinds.items()} == {
        "no draft tokens": 2, "no draft tokens + heads": 1, "verified drafts": 1, "verified drafts + heads": 1}
    assert kinds["no draft tokens"]["median_ms"]["step"] == pytest.approx(41.0)
    assert kinds["verified drafts + heads"]["rows"] == 3.0
    assert kinds["no draft tokens + heads"]["median_ms"]["heads"] == pytest.approx(1.0)
    rows = sp.summarize(recs, 1)["by_rows"]
    assert {n: v["steps"] for n, v in rows.items()} == {"1": 3, "3": 2}
    assert rows["1"]["median_ms"]["step"] == pytest.approx(42.0) and rows["3"]["median_ms"]["step"] == pytest.approx(53.0)
    plain = {"method": "plain", "tokens_per_s": 20.0, "rows": 1.0, "median_ms": dict.fromkeys(sp.PHASES, 10.0),
             "by_kind": {"no draft tokens": {"steps": 9, "rows": 1.0, "median_ms": dict.fromkeys(sp.PHASES, 10.0)}}}
    assert "By step kind" not in sp.format_table([plain])  # no speculative method: no second table
    spec = {**plain, "method": "entmtp", "by_kind": {k: {**v, "median_ms": {**dict.fromkeys(sp.PHASES, 0.0),
                                                                            **v["median_ms"]}}
                                                     for k, v in kinds.items()}}
    text = sp.format_table([plain, spec])
    assert "| entmtp | no draft tokens + heads | 1 | 1.00 | 45.00 |" in text
    assert "By rows verified" not in text  # neither method has steps of several row counts
    spec["by_rows"] = sp.summarize(recs, 1)["by_rows"]
    text = sp.format_table([plain, spec])
    assert "| entmtp | 1 | 3 | 42.00 |" in text and "| entmtp | 3 | 2 | 53.00 |" in text


def test_table_gives_each_phase_against_the_first_method():
    base = {"method": "plain", "tokens_per_s": 20.0, "rows": 1.0, "median_ms": dict.fromkeys(sp.PHASES, 10.0)}
    other = {"method": "entmtp", "tokens_per_s": 21.0, "rows": 2.0,
             "median_ms": {**dict.fromkeys(sp.PHASES, 10.0), "propose": 15.5}}
    text = sp.format_table([base, other])
    assert "| plain | 20.00 | 1.00 | 10.00 |" in text
    assert "15.50 (+5.50)" in text and "10.00 (+0.00)" in text
    assert len(text.splitlines()) == 4


def test_bad_methods_are_refused():
    with pytest.raises(SystemExit):
        sp.main(["--methods", "plain,nosuch"])
    with pytest.raises(SystemExit):
        sp.main(["--methods", "x={bad json"])


def test_methods_split_outside_json():
    spec = '{"method": "entmtp", "tree_set": "default", "tree_id": "b0n1"}'
    assert sp.split_methods(f"plain,n1={spec},ngram") == ["plain", f"n1={spec}", "ngram"]
    assert sp.split_methods('x={"a": [1, 2], "s": "1,2"}') == ['x={"a": [1, 2], "s": "1,2"}']
    assert sp.split_methods('x={"s": "say \\"a,b\\""},y') == ['x={"s": "say \\"a,b\\""}', "y"]


def test_time_split_sorts_every_step_by_kind_and_keeps_the_rest_outside():
    recs = [_rec(2, 300, 0, step=900.0),   # prompt tokens
            _rec(2, 2, 0, step=40.0),    # two requests decode, nothing drafted
            _rec(2, 5, 3, step=60.0),    # two requests decode with three draft tokens
            _rec(1, 2, 1, step=30.0)]    # one request left
    t = sp.time_split(recs, 1.5, 2)
    assert {k: v["steps"] for k, v in t.items()} == {"prefill": 1, "decode_drafting": 1, "decode_no_draft": 1,
                                                      "decode_fewer": 1, "outside": 0}
    assert t["prefill"]["s"] == pytest.approx(0.9) and t["decode_drafting"]["s"] == pytest.approx(0.06)
    assert t["outside"]["s"] == pytest.approx(1.5 - 0.9 - 0.04 - 0.06 - 0.03)


def test_processes_of_a_method_combine_by_the_median_of_their_medians():
    a = sp.summarize([_rec(1, 1, 0, step=40.0, forward=30.0), _rec(1, 3, 2, step=60.0, forward=32.0, heads=1.0)], 1)
    b = sp.summarize([_rec(1, 1, 0, step=44.0, forward=33.0)], 1)
    c = sp.summarize([_rec(1, 1, 0, step=41.0, forward=31.0), _rec(1, 1, 0, step=43.0, forward=31.0)], 1)
    runs = [{"method": "m", "tokens_per_s": t, **s} for t, s in ((10.0, a), (13.0, b), (16.0, c))]
    m = sp.combine(runs)
    assert m["process_step_ms"] == [50.0, 44.0, 42.0]
    assert m["median_ms"]["step"] == pytest.approx(44.0) and m["median_ms"]["forward"] == pytest.approx(31.0)
    assert m["tokens_per_s"] == pytest.approx(13.0) and m["decode_steps"] == 5
    # a kind seen in one process only is that process's
    assert m["by_kind"]["verified drafts + heads"]["steps"] == 1
    assert m["by_kind"]["verified drafts + heads"]["median_ms"]["heads"] == pytest.approx(1.0)
    assert m["by_kind"]["no draft tokens"]["steps"] == 4
    assert m["by_kind"]["no draft tokens"]["median_ms"]["step"] == pytest.approx(42.0)  # 40, 44, 42
    assert "Median step of each process (ms): m 50.00, 44.00, 42.00" in sp.format_table([m])
    assert m["by_rows"]["3"] == {"steps": 1, "median_ms": a["by_rows"]["3"]["median_ms"]}  # one process's
    assert m["by_rows"]["1"]["steps"] == 4 and m["by_rows"]["1"]["median_ms"]["forward"] == pytest.approx(31.0)
    split = {"prefill": {"steps": 2, "s": 1.0}, "outside": {"steps": 0, "s": 0.5}}
    two = sp.combine([{**runs[0], "steps": 9, "output_tokens": 100, "time_split": split},
                      {**runs[1], "steps": 7, "output_tokens": 90, "time_split": split}])
    assert (two["steps"], two["output_tokens"]) == (16, 190)
    assert two["time_split"] == {"prefill": {"steps": 4, "s": 2.0}, "outside": {"steps": 0, "s": 1.0}}


def test_bad_repeats_and_twice_the_same_method_name_are_refused(capsys):
    with pytest.raises(SystemExit) as e:
        sp.main(["--repeats", "0"])
    assert e.value.code == 2 and "--repeats must be >= 1" in capsys.readouterr().err  # argparse's error, no engine
    with pytest.raises(SystemExit) as e:  # two configs under one name would be taken for repeats of one method
        sp.main(["--methods", 'plain,entmtp,entmtp={"method": "entmtp", "tree": [[0]]}'])
    assert e.value.code == 2 and "each method needs a name of its own" in capsys.readouterr().err
