"""A step-time calibration: what one machine takes per step, fitted from a real run's steps.

Two models over a step's composition (`engine.step_cost`'s terms):
- forward: the model forward alone (`StepRecord.forward_s`), the scheduler's own
  `StepCostModel` fit (non-negative least squares, relative errors) over every step;
- overhead: the rest of a step's cycle — batch building, sampling, scheduling, publishing —
  `fixed + per sequence`, fitted on the gap from one step's start to the next's minus its
  forward, over steps that were followed at once by another (requests still running).

A simulated step lasts forward + overhead; the scheduler sees forward as its `forward_s`, as
it would in the engine. The forward is the prediction times a ratio drawn from the fitted
steps' own actual / predicted ratios (`forward_ratios`, engine/sim/noise.py). Saved as JSON
with the CPU, model name, dtype and KV cache dtype it was measured on.

Two regimes: on the GGUF path a step of at most kernel_max_rows rows (engine/cpu.py; tokens: 64
on AVX2, 8 on AVX-512, 16 for gguf-q8's int8 kernel) runs the block kernel and a larger one the dense fp32 GEMM
(engine/model/quant_linear.py), so one line through both over-predicts small steps and
under-predicts large ones. With `split_rows` the forward model is fitted twice, on the steps of
at most that many rows (`small_forward`) and on the others; the engine's live cost model splits
there too, and so does the simulated engine's.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np

from engine.messages import StepRecord
from engine.sim.noise import banded_quantiles, check_bands
from engine.step_cost import NAMES, StepCostModel, StepShape, linear_time, nonnegative_least_squares, shape_of

OVERHEAD_NAMES = ("fixed", "sequence")
SUSTAINED_MIN_S = 5.0  # the sustained slowdown is fitted only when a step was predicted this long
# A fit worse than these predicts step times too poorly to trust a simulation on it (the
# calibrations kept in docs/results fit at R² 0.95-0.9998, median error 3-15 %).
MIN_R2, MAX_ERROR_P50 = 0.9, 0.2


class Calibration(msgspec.Struct, frozen=True, kw_only=True):
    forward: dict[str, float]  # seconds per unit of each step_cost term (with split_rows: larger steps)
    small_forward: dict[str, float] | None = None  # steps of at most split_rows rows, fitted apart
    split_rows: int | None = None
    overhead: dict[str, float]  # seconds: fixed + per sequence
    num_steps: int  # steps fitted
    forward_r2: float | None = None
    forward_error_p50: float | None = None  # median |predicted - actual| / actual over the steps fitted
    # per band of predicted seconds (noise.BAND_EDGES_S), the percentiles (0..100) of actual /
    # predicted forward seconds of the steps fitted, None for a band with too few: the
    # simulator's step noise (engine/sim/noise.py); None: every step lasts its prediction
    forward_ratios: list[list[float] | None] | None = None
    # seconds^-1: a step predicted at p seconds lasts p * (1 + sustained * p). Minutes of
    # unbroken compute (continuous admitting 64 prompts in one step) run slower per token than
    # the ~1 s steps the linear terms are fitted on: 1.1x at 7 s, 1.3x at 31 s, 1.6x at 51 s here
    sustained: float = 0.0
    model: str = ""
    dtype: str = ""
    kv_cache_dtype: str = ""  # the KV cache's element type ("" in calibrations from before it was recorded)
    cpu: dict = {}
    max_model_len: int | None = None  # the model's context (requests longer are refused, as intake does)
    # the tokenizer's size (--run only): a generated workload draws prompt ids below it, as
    # engine-bench does, so both draw the same requests; None: 20000, as for any real model
    vocab_size: int | None = None
    source: str = ""

    def __post_init__(self):
        for terms in (self.forward, self.small_forward if self.small_forward is not None else self.forward):
            if set(terms) != set(NAMES):
                missing = [n for n in NAMES if n not in terms]
                hint = (f' (a calibration from before the {missing[-1]!r} term: set it to 0.0 to keep its predictions,'
                        ' or `engine-sim calibrate` again)') if missing == [NAMES[-1]] else ''
                raise ValueError(f"calibration forward terms must be {NAMES}, got {sorted(terms)}{hint}")
        if (self.small_forward is None) != (self.split_rows is None):
            raise ValueError("calibration: small_forward and split_rows go together")
        if set(self.overhead) != set(OVERHEAD_NAMES):
            raise ValueError(f"calibration overhead terms must be {OVERHEAD_NAMES}, got {sorted(self.overhead)}")
        if self.forward_ratios is not None:
            check_bands(self.forward_ratios)
        if self.sustained < 0:
            raise ValueError("calibration sustained must be >= 0")
        if any(v < 0 for v in (*self.forward.values(), *(self.small_forward or {}).values(), *self.overhead.values())):
            raise ValueError("calibration coefficients must be >= 0")

    def doubt(self) -> str | None:
        """Why a simulation on this calibration would mislead, or None when its fit is good."""
        r2, err = self.forward_r2, self.forward_error_p50
        if (r2 is None or r2 >= MIN_R2) and (err is None or err <= MAX_ERROR_P50):
            return None
        return (f"this calibration predicts step times poorly (forward R² {r2:.3f}, median error {err:.1%}; "
                f"good fits reach R² >= {MIN_R2} and <= {MAX_ERROR_P50:.0%}): its steps were too few or timed on a "
                "loaded machine; calibrate again from a longer run on a quiet one")

    def forward_s(self, shape: StepShape) -> float:
        p = self.linear_s(shape)
        return p * (1.0 + self.sustained * p)

    def linear_s(self, shape: StepShape) -> float:
        """The forward's linear terms alone."""
        f = self.forward
        if self.split_rows is not None and shape.num_rows <= self.split_rows:
            f = self.small_forward
        return linear_time([f[n] for n in NAMES], shape)

    def overhead_s(self, shape: StepShape) -> float:
        return self.overhead["fixed"] + self.overhead["sequence"] * shape.num_seqs

    def save(self, path: str | Path) -> None:
        Path(path).write_bytes(msgspec.json.format(msgspec.json.encode(self), indent=2) + b"\n")

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        try:
            return msgspec.json.decode(Path(path).read_bytes(), type=cls)
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            raise ValueError(f"{path}: not a calibration: {e}") from None


def record_shape(rec: StepRecord) -> StepShape:
    """The cost model's view of a recorded step: as `scheduler.plan_shape` saw its plan (a
    padding item belongs to the item before it, one sequence of tokens + pads)."""
    items: list[list] = []  # [tokens, position, is decode]
    for it in rec.items:
        if it.kind == "padding" and items and items[-1][3] == it.request_id:
            items[-1][0] += it.num_tokens
            items[-1][2] = False
        else:
            items.append([it.num_tokens, it.position, it.kind == "decode", it.request_id])
    return shape_of((n, pos, decode) for n, pos, decode, _ in items)


def fit(records: list[StepRecord], split_rows: int | None = None, **meta) -> Calibration:
    """`split_rows`: fit steps of at most that many rows apart (when each side has enough steps)."""
    steps = [r for r in records if not r.is_idle and r.error is None and r.forward_s > 0]
    if len(steps) < 2 * len(NAMES):
        raise ValueError(f"{len(steps)} usable steps: need at least {2 * len(NAMES)} to fit a calibration")
    shapes = [record_shape(r) for r in steps]
    times = [r.forward_s for r in steps]
    small = [split_rows is not None and s.num_rows <= split_rows for s in shapes]
    if min(sum(small), len(small) - sum(small)) < 2 * len(NAMES):
        split_rows, small = None, [False] * len(steps)
    big, _ = _fit_forward([s for s, k in zip(shapes, small) if not k], [t for t, k in zip(times, small) if not k])
    little = _fit_forward([s for s, k in zip(shapes, small) if k], [t for t, k in zip(times, small) if k])[0] \
        if split_rows is not None else None
    cal = Calibration(forward=big, small_forward=little, split_rows=split_rows, overhead=_fit_overhead(steps, shapes),
                      num_steps=len(steps), **meta)
    cal = msgspec.structs.replace(cal, sustained=_fit_sustained([cal.linear_s(s) for s in shapes], times))
    predicted = [cal.forward_s(s) for s in shapes]
    errors = [abs(p - t) / t for p, t in zip(predicted, times)]
    ratios = banded_quantiles(predicted, times)
    return msgspec.structs.replace(cal, forward_r2=_r2(predicted, times), forward_error_p50=float(np.median(errors)),
                                   forward_ratios=ratios)


def _fit_forward(shapes: list[StepShape], times: list[float]) -> tuple[dict[str, float], float | None]:
    model = StepCostModel(window=len(shapes), refit_every=len(shapes) + 1)  # one fit, over all of them
    for shape, t in zip(shapes, times):
        model.observe(shape, t)
    model.fit()
    return dict(zip(NAMES, map(float, model.coef))), model.r2


def _fit_sustained(linear: list[float], times: list[float]) -> float:
    """a >= 0 in actual / linear - 1 = a * linear, by least squares: the long steps set it (a 1 s
    step's share is a in 1), the short ones' scatter around 1 averages out. Without a step of at
    least SUSTAINED_MIN_S there is nothing to measure it on (fitted on the scatter of 1-2 s steps
    alone it came out 3 %/s, which would make a 40 s step 2.3x): 0."""
    if not linear or max(linear) < SUSTAINED_MIN_S:
        return 0.0
    p, r = np.asarray(linear), np.asarray(times) / np.maximum(np.asarray(linear), 1e-9)
    return max(0.0, float((p * (r - 1.0)).sum() / max((p * p).sum(), 1e-12)))


def _r2(predicted: list[float], actual: list[float]) -> float:
    y, p = np.asarray(actual), np.asarray(predicted)
    total = float(((y - y.mean()) ** 2).sum())
    return 1.0 - float(((y - p) ** 2).sum()) / total if total > 0 else 1.0


def _fit_overhead(steps: list[StepRecord], shapes: list[StepShape]) -> dict[str, float]:
    """fixed + per-sequence seconds between one step's forward end and the next step's start,
    from consecutive steps with requests still running between them (so the next step
    started as soon as the engine could). The slowest 5 % (a GC pause, a busy machine) are left out."""
    x, y = [], []
    for a, b, shape in zip(steps, steps[1:], shapes):
        if b.step != a.step + 1 or a.num_running == 0:
            continue
        gap = b.start_time - a.start_time - a.forward_s
        if gap >= 0:
            x.append([1.0, shape.num_seqs])
            y.append(gap)
    if len(y) < 4:
        return {"fixed": 0.0, "sequence": 0.0}
    xs, ys = np.asarray(x), np.asarray(y)
    keep = ys <= np.quantile(ys, 0.95)
    xs, ys = xs[keep], ys[keep]
    coef = nonnegative_least_squares(xs, ys)
    return dict(zip(OVERHEAD_NAMES, map(float, coef)))


def load_steps(path: str | Path) -> list[StepRecord]:
    """A StepRecord JSONL (`engine-bench --save-steps`)."""
    dec = msgspec.json.Decoder(StepRecord)
    out = []
    with open(path, "rb") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(dec.decode(line))
            except msgspec.DecodeError as e:
                raise ValueError(f"line {i}: {e}") from None
    return out
