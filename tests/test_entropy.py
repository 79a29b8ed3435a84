"""Entropy of logits, the bias-corrected EMA, and the per-request signal tracker (no vLLM)."""
import math

import pytest
import torch

from vllm_entmtp.entropy import NO_SIGNALS, BiasCorrectedEMA, EntropyTracker, Signals, entropy_nats

INF = float("inf")


# -- entropy_nats -----------------------------------------------------------------------------------------------


def test_uniform_is_log_v_and_one_hot_is_zero():
    for v in (2, 7, 1000):
        assert entropy_nats(torch.zeros(1, v)).item() == pytest.approx(math.log(v), rel=1e-6)
    one_hot = torch.full((1, 10), -INF)
    one_hot[0, 3] = 5.0
    assert entropy_nats(one_hot).item() == 0.0
    assert entropy_nats(torch.tensor([[1e4, 0.0, 0.0]])).item() == 0.0  # saturated: no NaN, no -0.0 sign issue


def test_matches_the_definition_and_shape_dtype():
    torch.manual_seed(0)
    x = torch.randn(5, 50, dtype=torch.float64) * 3
    p = x.softmax(-1)
    ref = -(p * p.log()).sum(-1)
    out = entropy_nats(x)
    assert out.shape == (5,) and out.dtype == torch.float32
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-6)
    assert entropy_nats(x.bfloat16()).dtype == torch.float32  # computed in float32 whatever the input
    assert entropy_nats(torch.zeros(2, 3, 4)).shape == (2, 3)


def test_matches_the_definition_at_the_targets_vocabulary_size():
    """Float32 over 49,152 entries (SmolLM2's vocabulary), from flat to peaked rows: within 1e-4 nats of the
    float64 definition."""
    torch.manual_seed(1)
    x = torch.randn(6, 49152, dtype=torch.float64) * torch.tensor([0.1, 1, 3, 8, 20, 60], dtype=torch.float64)[:, None]
    p = x.softmax(-1)
    ref = -(p * p.clamp_min(1e-300).log()).sum(-1)
    assert torch.allclose(entropy_nats(x.float()).double(), ref, rtol=1e-5, atol=1e-4)


def test_minus_inf_entries_are_ignored():
    masked = torch.tensor([[0.0, -INF, 0.0, -INF]])  # two live tokens of equal weight
    assert entropy_nats(masked).item() == pytest.approx(math.log(2), rel=1e-6)
    assert not torch.isnan(entropy_nats(masked)).any()


def test_degenerate_rows_give_nan_not_zero():
    x = torch.tensor([[-INF, -INF, -INF], [float("nan"), 0.0, 0.0], [INF, 0.0, 0.0], [0.0, 0.0, 0.0]])
    out = entropy_nats(x)
    assert torch.isnan(out[:3]).all() and out[3].item() == pytest.approx(math.log(3), rel=1e-6)


# -- BiasCorrectedEMA ---------------------------------------------------------------------------------------------


def test_ema_first_value_is_x_and_bias_corrected():
    e = BiasCorrectedEMA(16)
    assert e.value is None and e.count == 0
    assert e.update(2.5) == pytest.approx(2.5)
    assert e.value == pytest.approx(2.5) and e.count == 1
    # a constant input stays exactly that constant (no pull towards 0)
    for _ in range(50):
        assert e.update(2.5) == pytest.approx(2.5)


def test_ema_matches_the_formula():
    w, xs = 4, [1.0, 3.0, 0.0, 2.0, 5.0]
    beta, m = 1 - 1 / w, 0.0
    e = BiasCorrectedEMA(w)
    for t, x in enumerate(xs, start=1):
        m = beta * m + (1 - beta) * x
        assert e.update(x) == pytest.approx(m / (1 - beta ** t))
    w1 = BiasCorrectedEMA(1)
    assert [w1.update(x) for x in xs] == xs  # window 1 = the last value


@pytest.mark.parametrize("w", [0, -1, 1.5, True, "4"])
def test_ema_rejects_bad_windows(w):
    with pytest.raises(ValueError, match="window"):
        BiasCorrectedEMA(w)


# -- EntropyTracker -----------------------------------------------------------------------------------------------


def test_unknown_request_has_no_signals():
    tr = EntropyTracker()
    assert tr.signals("x") is NO_SIGNALS and NO_SIGNALS == Signals() and NO_SIGNALS.updates == 0
    assert len(tr) == 0 and "x" not in tr


def test_create_update_free():
    tr = EntropyTracker(entropy_window=4, acceptance_window=2)
    tr.update("a", 0.5)
    tr.update("b", 1.0, accepted=3)
    assert len(tr) == 2 and "a" in tr
    sa = tr.signals("a")
    assert sa == Signals(entropy_ema=0.5, entropy_last=0.5, updates=1)
    with pytest.raises(AttributeError):
        sa.updates = 3  # frozen
    assert tr.signals("b").acceptance_ema == pytest.approx(3.0)
    tr.free("a")
    tr.free("a")  # twice is fine
    assert len(tr) == 1 and tr.signals("a") is NO_SIGNALS


def test_signals_math():
    tr = EntropyTracker(entropy_window=4, acceptance_window=2, confidence_window=2)
    tr.update("r", 1.0, head_top1=[0.8, 0.5], accepted=2)
    tr.update("r", 0.2, head_top1=[0.6, 0.5], accepted=None)  # no draft verified this step
    tr.update("r", float("nan"), head_top1=None, accepted=0)  # a fully masked row: entropy not averaged
    s = tr.signals("r")
    b = 0.75
    m = b * (1 - b) * 1.0 + (1 - b) * 0.2
    assert s.entropy_ema == pytest.approx(m / (1 - b ** 2))
    assert s.entropy_last == 0.2
    h1 = (0.5 * 0.5 * 0.8 + 0.5 * 0.6) / (1 - 0.25)  # window 2 EMA of head 0: 0.8, 0.6
    assert s.confidence == pytest.approx(h1 * 0.5)
    assert s.confidence_last == pytest.approx(0.6 * 0.5)
    a = (0.5 * 0.5 * 2 + 0.5 * 0) / (1 - 0.25)
    assert s.acceptance_ema == pytest.approx(a)
    assert s.updates == 3


def test_head_count_change_restarts_the_heads_ema():
    tr = EntropyTracker()
    tr.update("r", 0.1, head_top1=[0.9, 0.9, 0.9])
    tr.update("r", 0.1, head_top1=[0.5, 0.4])
    assert tr.signals("r").confidence == pytest.approx(0.2)


def test_free_missing_leaves_no_state_after_thousands_of_requests():
    tr = EntropyTracker()
    active: list[str] = []
    for step in range(400):
        active = active[-30:] + [f"req-{step}-{j}" for j in range(5)]  # 2000 requests pass through
        tr.update_batch(active, [0.3] * len(active), accepted=[1] * len(active))
        tr.free_missing(active)
        assert len(tr) == len(active) == len(set(active))
    assert tr.free_missing([]) == len(active)
    assert len(tr) == 0 and tr._states == {}


def test_update_batch_takes_tensors_and_checks_lengths():
    tr = EntropyTracker(entropy_window=1, acceptance_window=1)
    tr.update_batch(["a", "b"], torch.tensor([0.5, 1.5]), head_top1=torch.tensor([[0.5, 0.5], [1.0, 0.25]]),
                    accepted=torch.tensor([2, 0]))
    a, b = tr.signals_batch(["a", "b"])
    assert (a.entropy_ema, a.confidence, a.acceptance_ema) == (0.5, 0.25, 2.0)
    assert (b.entropy_ema, b.confidence, b.acceptance_ema) == (1.5, 0.25, 0.0)
    tr.update_batch(["a", "b"], [0.1, 0.2], head_top1=[None, [0.5]], accepted=[None, 1])
    assert tr.signals("a").confidence == 0.25 and tr.signals("b").confidence == 0.5
    with pytest.raises(ValueError, match="entropies has 1 entries for 2 request ids"):
        tr.update_batch(["a", "b"], [0.1])
    with pytest.raises(ValueError, match="accepted has 3 entries"):
        tr.update_batch(["a", "b"], [0.1, 0.2], accepted=[1, 2, 3])


def test_from_config_and_bad_windows():
    from vllm_entmtp.config import EntMTPConfig

    tr = EntropyTracker.from_config(EntMTPConfig(entropy_window=4, acceptance_window=2))
    assert (tr.entropy_window, tr.acceptance_window, tr.confidence_window) == (4, 2, 1)  # confidence: this step's
    tr = EntropyTracker.from_config(EntMTPConfig(confidence_window=3))
    assert (tr.entropy_window, tr.confidence_window) == (16, 3)
    with pytest.raises(ValueError, match="window"):
        EntropyTracker(entropy_window=0)
