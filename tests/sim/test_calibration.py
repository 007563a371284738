"""Calibration: steps recorded on a known machine give that machine back."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from engine.sim import cli
from engine.sim import trace as traces
from engine.sim.calibration import SUSTAINED_MIN_S, Calibration, fit, load_steps, record_shape
from engine.sim.simulator import simulate
from tests.sim.util import CAL, config

REPO = Path(__file__).resolve().parents[2]


def recorded(policy: str, **kw):
    trace = traces.generate("mixed", seed=1, num_requests=48, rate=4.0)
    return simulate(trace, config(policy=policy, **kw), CAL, keep_steps=True).steps


@pytest.mark.parametrize("policy", ["continuous", "chunked", "static"])
def test_fit_recovers_the_machine(policy, tmp_path):
    steps = recorded(policy)
    cal = fit(steps, model="fake", dtype="float32")
    for name, want in CAL.forward.items():
        assert cal.forward[name] == pytest.approx(want, rel=1e-3, abs=1e-12), name
    for name, want in CAL.overhead.items():
        assert cal.overhead[name] == pytest.approx(want, rel=1e-3, abs=1e-9), name
    assert cal.forward_error_p50 < 1e-6
    cal.save(tmp_path / "c.json")
    assert Calibration.load(tmp_path / "c.json") == cal


def test_record_shape_is_the_plan_shape_including_padding():
    steps = recorded("static")
    assert any(r.num_padding_tokens for r in steps)
    for r in steps:
        assert CAL.forward_s(record_shape(r)) == pytest.approx(r.forward_s)


def test_steps_file_round_trip(tmp_path):
    import msgspec

    steps = recorded("chunked")
    path = tmp_path / "steps.jsonl"
    path.write_bytes(b"".join(msgspec.json.encode(s) + b"\n" for s in steps))
    assert load_steps(path) == steps
    path.write_bytes(msgspec.json.encode(steps[0]) + b"\n{oops\n")
    with pytest.raises(ValueError, match="^line 2: JSON is malformed"):  # the CLI adds "--steps PATH: "
        load_steps(path)


def test_bad_calibrations_are_refused(tmp_path):
    import msgspec

    path = tmp_path / "c.json"
    path.write_text('{"forward": {"fixed": 1}, "overhead": {"fixed": 0, "sequence": 0}, "num_steps": 1}')
    with pytest.raises(ValueError, match="forward terms"):
        Calibration.load(path)
    older = {"fixed": 0.01, "prefill_token": 1e-3, "decode_token": 1e-3, "sequence": 1e-3, "attention_pair": 1e-7}
    path.write_text(msgspec.json.encode({"forward": older, "overhead": {"fixed": 0, "sequence": 0},
                                         "num_steps": 1}).decode())
    with pytest.raises(ValueError, match="before the 'kv_token' term: set it to 0.0"):
        Calibration.load(path)
    with pytest.raises(ValueError, match="usable steps"):
        fit(recorded("chunked")[:3])



def test_fit_recovers_a_machine_with_two_regimes():
    """Steps of at most 16 rows cost differently (the GGUF kernel) from larger ones (dense):
    the split fit recovers both lines, and one line through both does not."""
    import msgspec

    small = {"fixed": 0.002, "prefill_token": 2e-3, "decode_token": 2e-3, "sequence": 1e-4, "attention_pair": 2e-8,
             "kv_token": 0.0}
    two = msgspec.structs.replace(CAL, small_forward=small, split_rows=16)
    steps = simulate(traces.generate("mixed", seed=1, num_requests=48, rate=4.0), config(policy="chunked"), two,
                     keep_steps=True).steps
    shapes = [record_shape(r) for r in steps if not r.is_idle]
    assert sum(s.prefill_tokens + s.decode_tokens <= 16 for s in shapes) >= 20  # both regimes occur
    cal = fit(steps, split_rows=16)
    assert cal.split_rows == 16 and cal.forward_error_p50 < 1e-6
    for s in shapes:
        assert cal.forward_s(s) == pytest.approx(two.forward_s(s), rel=1e-6)
    one = fit(steps, split_rows=None)
    assert one.split_rows is None and one.small_forward is None and one.forward_error_p50 > 1e-3


def test_a_calibration_without_a_split_still_loads():
    """Calibrations saved before the split (docs/results/sim/calibration.json) keep working."""
    from pathlib import Path

    cal = Calibration.load(Path(__file__).resolve().parents[2] / "docs" / "results" / "sim" / "calibration.json")
    assert cal.split_rows is None and cal.small_forward is None
    with pytest.raises(ValueError, match="go together"):
        Calibration(forward=CAL.forward, overhead=CAL.overhead, num_steps=0, split_rows=16)


def test_fit_finds_the_slowdown_of_long_steps():
    """Steps that run p * (1 + a * p) for a linear prediction p give a back; without a step of
    SUSTAINED_MIN_S or more there is nothing to fit it on: 0."""
    slow = msgspec.structs.replace(CAL, sustained=0.02)
    trace = [traces.TraceRequest(arrival_s=0.0, prompt_tokens=400 + 7 * k, output_tokens=4) for k in range(48)]
    steps = simulate(trace, config(policy="continuous", max_num_seqs=64, num_blocks=4096), slow, keep_steps=True,
                     step_noise=False).steps
    steps += recorded("chunked")  # short steps: their prediction
    cal = fit(steps, model="fake", dtype="float32")
    assert cal.sustained == pytest.approx(0.02, rel=0.2)
    short = recorded("chunked")
    assert max(CAL.forward_s(record_shape(r)) for r in short) < SUSTAINED_MIN_S
    assert fit(short, model="fake", dtype="float32").sustained == 0.0
    assert max(cal.linear_s(record_shape(r)) for r in steps) >= SUSTAINED_MIN_S


def test_a_poor_fit_is_doubted_and_said_by_the_cli(tmp_path, capsys):
    """A calibration from a few steps on a loaded machine used to be written, and replayed, silently."""
    assert CAL.doubt() is None  # no fit figures: nothing to doubt
    good = msgspec.structs.replace(CAL, forward_r2=0.95, forward_error_p50=0.15)
    assert good.doubt() is None
    for r2, err in ((-0.157, 0.562), (0.85, 0.05), (0.99, 0.25)):
        doubt = msgspec.structs.replace(CAL, forward_r2=r2, forward_error_p50=err).doubt()
        assert doubt and f"R² {r2:.3f}" in doubt and "calibrate again" in doubt
    poor = msgspec.structs.replace(CAL, forward_r2=-0.157, forward_error_p50=0.562)
    poor.save(tmp_path / "poor.json")
    cli.main(["run", "--config", str(REPO / "config.toml"), "--calibration", str(tmp_path / "poor.json"),
              "--workload", "mixed", "--num-requests", "4", "--no-plots", "--out", str(tmp_path / "sim")])
    assert "predicts step times poorly (forward R² -0.157, median error 56.2%" in capsys.readouterr().err
