"""A step's forward time, predicted from its composition and fitted live from real steps.

    t ≈ c0 + c1·prefill_tokens + c2·decode_tokens + c3·num_seqs + c4·attention_work + c5·kv_tokens

where attention_work = Σ over items of new_tokens × (context_len + (new_tokens + 1) / 2): the
query-key pairs the step computes (a chunk attends to the cached context and causally to
itself), and kv_tokens = Σ over items of context_len + new_tokens: the cached keys and values
the step reads. On a CPU each term is close to linear: GEMMs cost per token, attention per
pair computed and per cache position read. The two attention terms differ where it matters:
a decode reads a whole context's K/V (memory-bound) for one query, a prefill chunk reads it
once for hundreds of queries (compute-bound). With the pairs alone, fitted mostly on prefill,
decode steps with long contexts ran 15–25 % slower than predicted (sharegpt-like, ~500-token
contexts); a decode's context costs ~3 µs per position on SmolLM2 here (pair + read), ~4x a
prefill pair.

The executor reports every step's forward time; the model keeps the last `window` of them
and refits by non-negative least squares every `refit_every` steps (six unknowns: cheap),
weighting each step by 1/time so that it fits relative errors: small decode steps and large
prefill steps are predicted equally well. A step that ran more than `SURPRISE` off its
prediction is refitted on at once: the shapes a budgeted policy cares about (long prompt
chunks deep into their context) can be rare, and waiting `refit_every` steps for the next fit
meant a 2,000-token prompt was cut by predictions 17-24 % too high for all four of its chunks
(spike-overlap: 0.76-0.83 s steps predicted at 1.0 s).
Coefficients are kept non-negative so that a prediction never falls when work is added, which
the budgeted policy relies on when it grows a chunk until the budget is reached.
It is pure Python + NumPy and knows nothing of the engine: the simulator uses it too.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec
import numpy as np

NAMES = ("fixed", "prefill_token", "decode_token", "sequence", "attention_pair", "kv_token")
SURPRISE = 0.10  # |actual / predicted - 1| beyond which a step is fitted on at once


class StepShape(msgspec.Struct, frozen=True, array_like=True):
    """What a step computes, in the terms the cost model uses."""

    prefill_tokens: int = 0
    decode_tokens: int = 0
    num_seqs: int = 0
    attention_work: float = 0.0
    kv_tokens: int = 0

    @property
    def num_rows(self) -> int:
        """Tokens the step computes: the rows of its GEMMs (what picks kernel or dense weights)."""
        return self.prefill_tokens + self.decode_tokens

    def features(self) -> list[float]:
        return [1.0, self.prefill_tokens, self.decode_tokens, self.num_seqs, self.attention_work, self.kv_tokens]

    def plus(self, new_tokens: int, context_len: int, decode: bool) -> StepShape:
        """This shape with one more item of `new_tokens` tokens after `context_len` cached ones."""
        return StepShape(
            self.prefill_tokens + (0 if decode else new_tokens), self.decode_tokens + (new_tokens if decode else 0),
            self.num_seqs + 1, self.attention_work + attention_pairs(new_tokens, context_len),
            self.kv_tokens + context_len + new_tokens,
        )


def attention_pairs(new_tokens: int, context_len: int) -> float:
    return new_tokens * (context_len + (new_tokens + 1) / 2)


def linear_time(c: Sequence[float], shape: StepShape) -> float:
    """Σ c_i · feature_i: the model's formula for coefficients `c` in NAMES order (the live fit's
    and a saved calibration's alike); `features()` written out, without building the list."""
    return (c[0] + c[1] * shape.prefill_tokens + c[2] * shape.decode_tokens + c[3] * shape.num_seqs
            + c[4] * shape.attention_work + c[5] * shape.kv_tokens)


def shape_of(items: Iterable[tuple[int, int, bool]]) -> StepShape:
    """items: (new tokens, context length, is a decode)."""
    prefill = decode_tokens = seqs = kv = 0
    work = 0.0
    for n, ctx, decode in items:  # what chained `plus` calls give, without a struct per item
        if decode:
            decode_tokens += n
        else:
            prefill += n
        seqs += 1
        work += attention_pairs(n, ctx)
        kv += ctx + n
    return StepShape(prefill, decode_tokens, seqs, work, kv)


class CostFigures(msgspec.Struct, frozen=True, kw_only=True):
    """What /v1/engine/state shows of the model."""

    coefficients: dict[str, float]  # seconds per unit of each term (with split_rows: the larger steps)
    r2: float | None
    num_samples: int
    last_predicted_s: float | None
    last_actual_s: float | None
    split_rows: int | None = None  # steps of at most this many rows are fitted apart, by these:
    small_coefficients: dict[str, float] | None = None
    small_r2: float | None = None


class StepCostModel:
    """The live model. With `split_rows` (the most rows a step runs on the quantized-weight
    kernels, `LlamaModel.small_step_rows`), steps of at most that many rows (tokens) are fitted
    apart from the larger ones: the kernels and the dense GEMM are two different lines (at one
    thread on AVX-512, 8 decodes took 73 ms on the kernels and 32 took 140 ms on the GEMM), and
    one line through both mispredicts the steps a run is made of. A side not fitted yet is
    predicted by the other."""

    def __init__(self, window: int = 256, refit_every: int = 8, split_rows: int | None = None):
        self.split_rows = split_rows
        self.large = Fit(window, refit_every)  # every step, or those above split_rows
        self.small = Fit(window, refit_every) if split_rows is not None else None
        self.last_predicted_s: float | None = None
        self.last_actual_s: float | None = None

    def _side(self, shape: StepShape) -> Fit:
        if self.small is not None and shape.num_rows <= self.split_rows:
            return self.small
        return self.large

    @property
    def is_fitted(self) -> bool:
        return self.large.is_fitted or self.small is not None and self.small.is_fitted

    @property
    def num_samples(self) -> int:
        return self.large.num_samples + (self.small.num_samples if self.small is not None else 0)

    @property
    def coef(self) -> np.ndarray:
        return self.large.coef

    @property
    def r2(self) -> float | None:
        return self.large.r2

    def predict(self, shape: StepShape) -> float:
        side = self._side(shape)
        if not side.is_fitted and self.small is not None:
            side = self.small if side is self.large else self.large
        return side.predict(shape)

    def observe(self, shape: StepShape, seconds: float, predicted: float | None = None) -> None:
        surprise = predicted is not None and predicted > 0 and abs(seconds / predicted - 1) > SURPRISE
        self._side(shape).observe(shape, seconds, refit=surprise)
        self.last_predicted_s, self.last_actual_s = predicted, seconds

    def fit(self) -> None:
        self.large.fit()
        if self.small is not None:
            self.small.fit()

    def figures(self) -> CostFigures:
        small = self.small
        return CostFigures(
            coefficients=self.large.coefficients(), r2=self.large.r2, num_samples=self.num_samples,
            last_predicted_s=self.last_predicted_s, last_actual_s=self.last_actual_s, split_rows=self.split_rows,
            small_coefficients=small.coefficients() if small is not None else None,
            small_r2=small.r2 if small is not None else None,
        )


class Fit:
    """One line through the last `window` steps, refitted every `refit_every` of them."""

    def __init__(self, window: int, refit_every: int):
        self.window = window
        self.refit_every = refit_every
        # the last `window` steps in a ring (row i % window): fitting reads them without a copy
        self._x = np.zeros((window, len(NAMES)))
        self._y = np.zeros(window)
        self._num_seen = 0
        self.coef = np.zeros(len(NAMES))
        self._coef = (0.0,) * len(NAMES)  # the same as floats: predict() is called ~10 times a step
        self.r2: float | None = None
        self._since_fit = 0

    @property
    def is_fitted(self) -> bool:
        return self.r2 is not None

    @property
    def num_samples(self) -> int:
        return min(self._num_seen, self.window)

    def coefficients(self) -> dict[str, float]:
        return dict(zip(NAMES, self._coef))

    def predict(self, shape: StepShape) -> float:
        return linear_time(self._coef, shape)

    def observe(self, shape: StepShape, seconds: float, refit: bool = False) -> None:
        """Add a step; fit again when `refit_every` steps came since the last fit, or `refit`."""
        row = self._num_seen % self.window
        self._x[row] = shape.features()
        self._y[row] = seconds
        self._num_seen += 1
        self._since_fit += 1
        due = self._since_fit >= self.refit_every or refit and self.is_fitted
        if due or not self.is_fitted and self.num_samples >= len(NAMES):
            self.fit()

    def fit(self) -> None:
        self._since_fit = 0
        n = self.num_samples
        if n < 2:
            return
        x, y = self._x[:n], self._y[:n]
        # relative errors: a 5 ms decode step matters as much as a 1 s prefill step
        w = 1.0 / np.maximum(y, 1e-4)
        self.coef = nonnegative_least_squares(x * w[:, None], y * w)
        self._coef = tuple(map(float, self.coef))
        residual = y - x @ self.coef
        total = float(((y - y.mean()) ** 2).sum())
        self.r2 = 1.0 - float((residual**2).sum()) / total if total > 0 else 1.0


def nonnegative_least_squares(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """min ||x·c - y|| with c >= 0, by dropping the most negative coefficient and refitting
    (an active-set loop; six columns, so at most six rounds). Columns are scaled first: the
    terms differ by orders of magnitude (1 vs. millions of attention pairs)."""
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0
    xs = x / scale
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(xs[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return coef / scale
