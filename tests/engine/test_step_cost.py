"""The step-cost model recovers known costs from synthetic steps and stays non-negative."""

from __future__ import annotations

import random

import numpy as np
import pytest

from engine.step_cost import StepCostModel, StepShape, attention_pairs, nonnegative_least_squares, shape_of

# fixed, per prefill token, per decode, per seq, per pair, per cached K/V position read
TRUE = np.array([0.004, 2e-4, 3e-4, 5e-4, 2e-8, 4e-7])


def random_step(rng: random.Random) -> StepShape:
    items = [(1, rng.randint(10, 2000), True) for _ in range(rng.randint(0, 64))]
    items += [(rng.randint(16, 512), rng.randint(0, 4000), False) for _ in range(rng.randint(0, 3))]
    return shape_of(items or [(1, 1, True)])


def test_recovers_known_coefficients():
    rng = random.Random(0)
    model = StepCostModel(window=256, refit_every=8)
    for _ in range(200):
        s = random_step(rng)
        model.observe(s, float(np.dot(TRUE, s.features())))
    np.testing.assert_allclose(model.coef, TRUE, rtol=1e-6)
    assert model.r2 == pytest.approx(1.0)


def test_predicts_noisy_steps_within_a_few_percent():
    rng = random.Random(1)
    model = StepCostModel(window=256, refit_every=8)
    for _ in range(256):
        s = random_step(rng)
        model.observe(s, float(np.dot(TRUE, s.features())) * rng.uniform(0.97, 1.03))
    assert model.r2 > 0.98
    errors = []
    for _ in range(100):
        s = random_step(rng)
        want = float(np.dot(TRUE, s.features()))
        errors.append(abs(model.predict(s) - want) / want)
    assert float(np.median(errors)) < 0.03


def test_coefficients_never_go_negative():
    x = np.array([[1, 1, 0], [1, 2, 0], [1, 3, 0], [1, 4, 1]], dtype=float)
    y = np.array([4.0, 3.0, 2.0, 1.0])  # time falls with the second column: least squares says < 0
    coef = nonnegative_least_squares(x, y)
    assert (coef >= 0).all()


def test_shapes():
    assert attention_pairs(1, 99) == 100  # a decode attends to 99 cached keys and itself
    assert attention_pairs(4, 0) == 10  # a fresh 4-token chunk: 1 + 2 + 3 + 4 causal pairs
    s = StepShape().plus(1, 10, True).plus(32, 0, False)
    assert (s.prefill_tokens, s.decode_tokens, s.num_seqs) == (32, 1, 2)
    assert s.kv_tokens == 11 + 32  # the decode reads its 10 cached positions and its own, the chunk its 32
    assert s == shape_of([(1, 10, True), (32, 0, False)])


def test_decodes_with_long_contexts_are_priced_by_their_kv_reads():
    """A decode reads its whole context's K/V for one query (memory-bound); a prefill chunk reads
    it once for hundreds of queries. Fitted on prefill-heavy steps and short-context decodes,
    the model still prices long-context decodes right, where the pairs alone could not: this
    is what made sharegpt-like's decodes (~500-token contexts) run 15-25 % over their predictions."""
    rng = random.Random(5)
    truth = np.array([0.02, 1e-3, 0.0, 1.4e-3, 7e-7, 3e-6])  # about SmolLM2 on the dense path here
    train = [shape_of([(rng.randint(64, 512), rng.randint(0, 1500), False) for _ in range(rng.randint(1, 2))]
                      + [(1, rng.randint(100, 350), True) for _ in range(rng.randint(0, 40))]) for _ in range(120)]
    train += [shape_of([(1, rng.randint(100, 350), True) for _ in range(rng.randint(13, 64))]) for _ in range(40)]
    model = StepCostModel(window=256)
    for s in train:
        model.observe(s, float(np.dot(truth, s.features())))
    long_decodes = shape_of([(1, rng.randint(400, 600), True) for _ in range(48)])
    want = float(np.dot(truth, long_decodes.features()))
    assert model.predict(long_decodes) == pytest.approx(want, rel=1e-6)
    # the same steps' prices with the K/V reads folded into the pairs (the five-term model)
    pairs_only = nonnegative_least_squares(np.array([s.features()[:5] for s in train]),
                                           np.array([np.dot(truth, s.features()) for s in train]))
    assert float(np.dot(pairs_only, long_decodes.features()[:5])) < 0.95 * want


def test_unfitted_predicts_zero_and_reports_figures():
    model = StepCostModel()
    assert model.predict(StepShape(10, 10, 2, 100.0)) == 0.0 and not model.is_fitted
    for i in range(6):  # one step per unknown
        model.observe(StepShape(10 * i, 1, 1, 10.0 * i), 0.01 + 0.001 * i, predicted=None)
    assert model.is_fitted
    f = model.figures()
    assert f.num_samples == 6 and set(f.coefficients) == {"fixed", "prefill_token", "decode_token", "sequence",
                                                          "attention_pair", "kv_token"}


def test_fits_only_the_last_window_of_steps():
    """The machine changed speed: once `window` steps of the new speed are in, the old ones are gone."""
    rng = random.Random(2)
    model = StepCostModel(window=32, refit_every=1)
    for _ in range(50):  # more than a window of the old machine, so the ring wraps
        s = random_step(rng)
        model.observe(s, float(np.dot(TRUE, s.features())))
    for k in range(32):
        s = random_step(rng)
        model.observe(s, float(np.dot(2 * TRUE, s.features())))
        if k < 31:  # old steps still in the window: neither machine's coefficients
            assert not np.allclose(model.coef, 2 * TRUE, rtol=1e-6)
    np.testing.assert_allclose(model.coef, 2 * TRUE, rtol=1e-6)
    assert model.figures().num_samples == 32
    s = random_step(rng)
    assert model.predict(s) == pytest.approx(float(np.dot(2 * TRUE, s.features())), rel=1e-9)


SMALL = np.array([0.002, 0.0, 9e-3, 0.0, 1e-8, 2e-6])  # the kernels: a cheap pass, dear rows


def two_regime_time(s: StepShape, split: int) -> float:
    small = s.prefill_tokens + s.decode_tokens <= split
    return float(np.dot(SMALL if small else TRUE, s.features()))


def test_split_model_fits_the_kernel_and_the_dense_steps_apart():
    rng = random.Random(3)
    steps = [shape_of([(1, rng.randint(10, 2000), True) for _ in range(rng.randint(1, 12))]) for _ in range(60)]
    steps += [random_step(rng) for _ in range(60)]
    rng.shuffle(steps)
    split, one = StepCostModel(split_rows=12), StepCostModel()
    for s in steps:
        for model in (split, one):
            model.observe(s, two_regime_time(s, 12))
    np.testing.assert_allclose(split.large.coef, TRUE, rtol=1e-6)
    # decode-only steps have as many sequences as tokens and as many pairs as K/V positions
    # read: the small side may split those prices
    c = split.small.coef
    np.testing.assert_allclose([c[0], c[1], c[2] + c[3], c[4] + c[5]], [0.002, 0.0, 9e-3, 1e-8 + 2e-6],
                               rtol=1e-6, atol=1e-12)
    errors = {id(m): [] for m in (split, one)}
    for _ in range(100):
        s = random_step(rng) if rng.random() < 0.5 else shape_of([(1, 500, True)] * rng.randint(1, 12))
        want = two_regime_time(s, 12)
        for model in (split, one):
            errors[id(model)].append(abs(model.predict(s) - want) / want)
    assert max(errors[id(split)]) < 1e-6
    assert float(np.median(errors[id(one)])) > 0.05  # one line through both is what the split fixes
    f = split.figures()
    assert f.split_rows == 12 and f.small_r2 == pytest.approx(1.0) and f.num_samples == 120
    assert set(f.small_coefficients) == set(f.coefficients)


def test_a_side_not_fitted_yet_is_predicted_by_the_other():
    model = StepCostModel(split_rows=12)
    rng = random.Random(4)
    large = [s for s in (random_step(rng) for _ in range(100)) if s.prefill_tokens + s.decode_tokens > 12]
    for s in large[:40]:
        model.observe(s, float(np.dot(TRUE, s.features())))
    assert model.is_fitted and not model.small.is_fitted
    decode = shape_of([(1, 100, True)] * 4)
    assert model.predict(decode) == pytest.approx(float(np.dot(TRUE, decode.features())))


async def test_the_engine_fits_the_kernel_steps_apart_on_gguf_weights(tmp_path):
    """The engine's live model splits where its model hands the GGUF kernels over to the dense
    copies, and the start-up calibration gives both sides steps (so both are fitted)."""
    from engine import Engine
    from engine.cpu import NATIVE_MAX_ROWS, kernel_isa
    from tests.engine.util import greedy, run_request, tiny_config
    from tests.model.test_gguf_weights import write_tiny_gguf

    loaded = write_tiny_gguf(tmp_path / "tiny.gguf")
    config = tiny_config(calibrate_step_cost=True, weight_format="gguf", attention_backend="torch")
    async with Engine(config, loaded=loaded) as engine:
        cost = engine.scheduler.cost
        assert cost.split_rows == NATIVE_MAX_ROWS[kernel_isa()] and cost.small.is_fitted and cost.large.is_fitted
        await run_request(engine, [5, 6, 7], greedy(4))
        figures = engine.step_cost()
        assert figures.split_rows == cost.split_rows and figures.small_coefficients is not None


def test_a_step_far_off_its_prediction_is_fitted_on_at_once():
    rng = random.Random(2)
    decodes = [shape_of([(1, rng.randint(10, 500), True)] * rng.randint(1, 64)) for _ in range(64)]
    long_chunk = shape_of([(1, 100, True)] * 12 + [(500, 1500, False)])
    cheap_pairs = TRUE * [1, 1, 1, 1, 0.25, 1]  # prompt pairs deep in a context cost less than decodes suggest

    def fed(observe_chunk_times: int) -> float:  # relative error predicting the chunk after that many
        model = StepCostModel(window=256, refit_every=100)
        for s in decodes:  # decodes alone: a decode's pairs and reads are the same number
            model.observe(s, float(np.dot(TRUE, s.features())))
        model.fit()
        truth = float(np.dot(cheap_pairs, long_chunk.features()))
        for _ in range(observe_chunk_times):
            model.observe(long_chunk, truth, model.predict(long_chunk))
        return model.predict(long_chunk) / truth - 1

    assert fed(0) > 0.2  # the decodes overprice the chunk
    assert abs(fed(1)) < 0.02  # one surprise: refitted at once
    model = StepCostModel(window=256, refit_every=100)
    for s in decodes[:3]:  # a surprise never fits a side on fewer samples than unknowns
        model.observe(s, 0.01, predicted=1.0)
    assert not model.large.is_fitted
