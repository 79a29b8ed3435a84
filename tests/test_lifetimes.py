"""Per-request lifetimes (vllm_entmtp/lifetimes.py): every holder frees the requests vLLM no longer holds."""
import pytest

from vllm_entmtp.entropy import EntropyTracker
from vllm_entmtp.lifetimes import Lifetimes, drop_missing
from vllm_entmtp.lookup import PromptLookup


def test_drop_missing_on_dicts_and_sets():
    d, s = {"a": 1, "b": 2, "c": 3}, {"a", "b", "c"}
    assert drop_missing(d, ["b"]) == 2 and d == {"b": 2}
    assert drop_missing(s, {"b": None, "z": None}) == 2 and s == {"b"}
    assert drop_missing(d, {"b"}) == 0 and d == {"b": 2}


def test_every_holder_is_freed_and_none_is_skipped():
    pending, warned = {"a": 0, "b": 0}, {"a", "c"}
    tracker = EntropyTracker()
    for rid in ("a", "b", "c"):
        tracker.update(rid, entropy=1.0)
    lookup = PromptLookup(2, 4, max_tokens=4)
    lookup.observe("c", 3, 2)
    switched_off = {"holder": None}  # e.g. the scheduler where tree attention is not available
    lt = Lifetimes()
    lt.add("pending", lambda: pending)
    lt.add("warned", lambda: warned)
    lt.add("tracker", lambda: tracker)
    lt.add("lookup", lambda: lookup)
    lt.add("off", lambda: switched_off["holder"])
    assert lt.held() == {"pending": {"a", "b"}, "warned": {"a", "c"}, "tracker": {"a", "b", "c"},
                         "lookup": {"c"}}
    assert lt.held_ids() == {"a", "b", "c"}
    lt.free_missing(["b"])
    assert pending == {"b": 0} and warned == set() and tracker.tracked_ids() == {"b"}
    assert lookup.tracked_ids() == set()
    assert lt.held() == {"pending": {"b"}, "tracker": {"b"}}
    switched_off["holder"] = {"b": 1, "gone": 2}  # a holder switched on later is read at each call
    lt.free_missing({"b"})
    assert switched_off["holder"] == {"b": 1}
    lt.free_missing([])
    assert lt.held_ids() == set()


def test_a_name_is_registered_once():
    lt = Lifetimes()
    lt.add("pending", dict)
    with pytest.raises(ValueError, match="'pending' is registered already"):
        lt.add("pending", dict)


def test_the_drafter_counts_the_requests_that_left_between_its_steps():
    """The load rule's realised comparison ages drafted steps by the requests that left; vLLM announces a finish
    in the next step, which skips the runner where nothing else runs, so the drafter counts the requests missing
    from the runner's at its next step instead."""
    from types import SimpleNamespace

    from vllm_entmtp.drafter import EntMTPProposer

    d = SimpleNamespace(_live_seen=None, _departed=0, lifetimes=Lifetimes())
    EntMTPProposer.free_missing(d, {"a": 0, "b": 0})
    assert d._departed == 0  # the first step: nobody left
    EntMTPProposer.free_missing(d, {"b": 0, "c": 0})  # a left, c arrived
    EntMTPProposer.free_missing(d, {"b": 0, "c": 0})
    assert d._departed == 1
    EntMTPProposer.free_missing(d, [])
    assert d._departed == 3
