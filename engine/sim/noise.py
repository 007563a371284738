"""Step-time noise: real steps scatter around the cost model's prediction (other work on the
machine, caches, the OS), and a budgeted policy's worst gaps come from that scatter: a step
predicted at the budget that runs 20 % over it. A simulated step's forward time is the
calibration's prediction times a ratio drawn from the calibration's own actual / predicted
ratios (their percentiles, by inverse CDF with linear interpolation), from a seeded generator:
the same seed gives the same run.

The ratios are kept per band of predicted duration (BAND_EDGES_S): a 40 s step averages out
the jitter that scatters 0.1 s steps by +-20 %. A band with fewer than MIN_BAND_STEPS fitted
steps has no noise: its steps last their prediction."""

from __future__ import annotations

import random

import numpy as np

NUM_QUANTILES = 101  # 0, 1, ..., 100 %
BAND_EDGES_S = (0.1, 0.3, 1.0, 3.0)  # bands of predicted seconds: [0, 0.1), [0.1, 0.3), ..., [3, inf)
MIN_BAND_STEPS = 20


def ratio_quantiles(ratios: list[float]) -> list[float]:
    """The percentiles of `ratios` (actual / predicted forward seconds of the steps fitted)."""
    return np.quantile(ratios, np.linspace(0.0, 1.0, NUM_QUANTILES)).tolist()


def band_of(predicted_s: float) -> int:
    return sum(predicted_s >= edge for edge in BAND_EDGES_S)


def banded_quantiles(predicted: list[float], actual: list[float]) -> list[list[float] | None]:
    """Per band: the percentiles of actual / predicted of its steps, None for too few steps."""
    bands: list[list[float]] = [[] for _ in range(len(BAND_EDGES_S) + 1)]
    for p, t in zip(predicted, actual):
        if p > 0:
            bands[band_of(p)].append(t / p)
    return [ratio_quantiles(r) if len(r) >= MIN_BAND_STEPS else None for r in bands]


def check_bands(bands: list[list[float] | None]) -> None:
    if len(bands) != len(BAND_EDGES_S) + 1:
        raise ValueError(f"step noise needs {len(BAND_EDGES_S) + 1} bands (edges {BAND_EDGES_S} s), got {len(bands)}")
    for q in bands:
        if q is not None and (len(q) < 2 or q[0] <= 0 or any(b < a for a, b in zip(q, q[1:]))):
            raise ValueError("a step noise band needs >= 2 positive, non-decreasing quantiles")


class StepNoise:
    def __init__(self, bands: list[list[float] | None], seed: int):
        check_bands(bands)
        self.bands = bands
        self.rng = random.Random(seed)

    def __call__(self, predicted_s: float) -> float:
        """The ratio for one step predicted at `predicted_s` seconds."""
        q = self.bands[band_of(predicted_s)]
        if q is None:
            return 1.0
        at = self.rng.random() * (len(q) - 1)
        i = int(at)
        return q[i] + (q[i + 1] - q[i]) * (at - i)
