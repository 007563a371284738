"""Step noise: a simulated step's forward time is its prediction times a ratio drawn from the
calibration's actual / predicted percentiles (per band of predicted duration), from a seeded
generator."""

from __future__ import annotations

import msgspec
import pytest

from engine.sim import trace as traces
from engine.sim.calibration import Calibration, fit, record_shape
from engine.sim.noise import BAND_EDGES_S, MIN_BAND_STEPS, NUM_QUANTILES, StepNoise, band_of, banded_quantiles, \
    ratio_quantiles
from engine.sim.simulator import simulate
from tests.sim.util import CAL, config

NUM_BANDS = len(BAND_EDGES_S) + 1


def test_quantiles_of_known_ratios():
    q = ratio_quantiles([1.0 + k / 100 for k in range(101)])  # 1.00 .. 2.00
    assert len(q) == NUM_QUANTILES and q[0] == 1.0 and q[50] == pytest.approx(1.5) and q[-1] == pytest.approx(2.0)
    assert ratio_quantiles([1.3]) == [1.3] * NUM_QUANTILES


def test_bands_keep_the_ratios_of_their_steps_and_need_enough_of_them():
    predicted = [0.05] * 30 + [0.5] * 30 + [5.0] * (MIN_BAND_STEPS - 1)
    actual = [0.05 * 1.2] * 30 + [0.5 * 0.9] * 30 + [5.0 * 1.5] * (MIN_BAND_STEPS - 1)
    bands = banded_quantiles(predicted, actual)
    assert len(bands) == NUM_BANDS
    assert bands[band_of(0.05)] == pytest.approx([1.2] * NUM_QUANTILES)
    assert bands[band_of(0.5)] == pytest.approx([0.9] * NUM_QUANTILES)
    assert bands[band_of(5.0)] is None  # too few long steps: they last their prediction
    assert StepNoise(bands, 0)(5.0) == 1.0 and StepNoise(bands, 0)(0.05) == pytest.approx(1.2)


def test_draws_follow_the_quantiles_and_the_seed():
    q = ratio_quantiles([0.8, 1.0, 1.0, 1.2, 2.0])
    bands = [q] * NUM_BANDS
    a, b, c = StepNoise(bands, 1), StepNoise(bands, 1), StepNoise(bands, 2)
    xs = [a(0.5) for _ in range(2000)]
    assert xs == [b(0.5) for _ in range(2000)] and xs != [c(0.5) for _ in range(2000)]
    assert min(xs) >= 0.8 and max(xs) <= 2.0
    assert sorted(xs)[1000] == pytest.approx(1.0, abs=0.02)  # the median ratio
    assert sum(x > 1.2 for x in xs) / len(xs) == pytest.approx(0.25, abs=0.04)  # the top quarter: 1.2 .. 2.0
    with pytest.raises(ValueError):
        StepNoise([[1.0, 0.9]] * NUM_BANDS, 0)
    with pytest.raises(ValueError):
        StepNoise([q], 0)


def noisy(ratio_values: list[float]) -> Calibration:
    return msgspec.structs.replace(CAL, forward_ratios=[ratio_quantiles(ratio_values)] * NUM_BANDS)


def test_each_simulated_step_is_its_prediction_times_a_drawn_ratio():
    trace = traces.generate("mixed", seed=1, num_requests=24, rate=4.0)
    res = simulate(trace, config(policy="chunked"), noisy([2.0]), keep_steps=True)
    assert res.steps and all(r.forward_s == pytest.approx(2 * CAL.forward_s(record_shape(r))) for r in res.steps)
    off = simulate(trace, config(policy="chunked"), noisy([2.0]), keep_steps=True, step_noise=False)
    assert all(r.forward_s == pytest.approx(CAL.forward_s(record_shape(r))) for r in off.steps)


def test_noise_is_seeded_and_widens_the_gaps():
    trace = traces.generate("mixed", seed=1, num_requests=48, rate=4.0)
    cal = noisy([0.7, 0.9, 1.0, 1.0, 1.1, 1.6])
    a = simulate(trace, config(policy="chunked"), cal, keep_steps=True, seed=3)
    b = simulate(trace, config(policy="chunked"), cal, keep_steps=True, seed=3)
    c = simulate(trace, config(policy="chunked"), cal, keep_steps=True, seed=4)
    forwards = [r.forward_s for r in a.steps]
    assert forwards == [r.forward_s for r in b.steps] and forwards != [r.forward_s for r in c.steps]
    ratios = [r.forward_s / CAL.forward_s(record_shape(r)) for r in a.steps]
    assert min(ratios) < 0.8 and max(ratios) > 1.4  # drawn across the ratios' whole range
    quiet = simulate(trace, config(policy="chunked"), cal, keep_steps=True, step_noise=False)
    assert all(r.forward_s == pytest.approx(CAL.forward_s(record_shape(r))) for r in quiet.steps)


def test_fit_keeps_the_ratios_of_its_steps():
    steps = simulate(traces.generate("mixed", seed=1, num_requests=48, rate=4.0), config(policy="chunked"),
                     noisy([0.9, 1.0, 1.1]), keep_steps=True, seed=5).steps
    cal = fit(steps, model="fake", dtype="float32")
    filled = [q for q in cal.forward_ratios if q is not None]
    assert len(cal.forward_ratios) == NUM_BANDS and filled
    for q in filled:
        assert len(q) == NUM_QUANTILES and q == sorted(q)
        assert q[0] == pytest.approx(0.9, abs=0.05) and q[50] == pytest.approx(1.0, abs=0.05)
        assert q[-1] == pytest.approx(1.1, abs=0.05)
