from __future__ import annotations

import re
import statistics

import pytest

from engine.bench import workload
from engine.sim import trace as traces
from engine.sim.trace import TraceRequest


def test_round_trip_and_optional_fields(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"arrival_s": 0.5, "prompt_tokens": 12, "output_tokens": 3}\n\n'
                    '{"arrival_s": 1, "prompt_tokens": 40, "output_tokens": 8, "prefix_group": "a", '
                    '"prefix_tokens": 32, "priority": -1}\n')
    got = traces.load(path)
    assert got == [TraceRequest(arrival_s=0.5, prompt_tokens=12, output_tokens=3),
                   TraceRequest(arrival_s=1.0, prompt_tokens=40, output_tokens=8, prefix_group="a", prefix_tokens=32,
                                priority=-1)]
    traces.save(got, tmp_path / "u.jsonl")
    assert traces.load(tmp_path / "u.jsonl") == got
    assert "tag" not in (tmp_path / "u.jsonl").read_text()  # defaults are left out


@pytest.mark.parametrize("line, why", [
    ('{"arrival_s": 0, "prompt_tokens": 1, "output_tokens": 1, "temperature": 0.7}', "temperature"),
    ('{"arrival_s": 0, "prompt_tokens": 0, "output_tokens": 1}', "prompt_tokens"),
    ('{"arrival_s": -1, "prompt_tokens": 1, "output_tokens": 1}', "arrival_s"),
    ('{"arrival_s": 0, "prompt_tokens": 4, "output_tokens": 1, "prefix_tokens": 8, "prefix_group": 1}', "prefix_tokens"),
    ('{"arrival_s": 0, "prompt_tokens": 4, "output_tokens": 1, "prefix_tokens": 2}', "prefix_group"),
    ('{"prompt_tokens": 4, "output_tokens": 1}', "arrival_s"),
    ('{"arrival_s": 0, oops}', "JSON is malformed"),  # it named no file and no line
])
def test_bad_lines_are_refused_by_name(tmp_path, line, why):
    path = tmp_path / "t.jsonl"
    path.write_text('{"arrival_s": 0, "prompt_tokens": 1, "output_tokens": 1}\n\n' + line + "\n")
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))}: trace line 3: .*{why}"):
        traces.load(path)


def test_generators_are_the_bench_s_workloads():
    for name in ("mixed", "sharegpt-like", "spike", "spike-overlap", "shared-prefix"):
        bench = workload.make(name, 3, 20, 0.0 if name.startswith("spike") else 2.0)
        sim = traces.generate(name, 3, 20, 0.0 if name.startswith("spike") else 2.0)
        assert [(len(b.prompt_token_ids), b.max_tokens, b.arrival_s, b.tag, b.after_tokens, b.after_gate_s)
                for b in bench] == [(s.prompt_tokens, s.output_tokens, s.arrival_s, s.tag, s.after_tokens,
                                     s.after_gate_s) for s in sim]
    # a vocabulary under 20,000 (tiny-random's 259) draws prompt ids, and so lengths, differently
    bench, sim = workload.make("mixed", 0, 64, 0.0, 259), traces.generate("mixed", 0, 64, vocab_size=259)
    assert [(len(b.prompt_token_ids), b.max_tokens) for b in bench] == [(s.prompt_tokens, s.output_tokens) for s in sim]
    shared = traces.generate("shared-prefix", 0, 50)
    assert {r.prefix_tokens for r in shared} == {1000} and len({r.prefix_group for r in shared}) == 8


def test_gamma_arrivals_have_the_rate_and_burstiness_asked():
    for cv in (0.5, 1.0, 3.0):
        t = traces.generate("sharegpt-like", 0, 4000, 10.0, arrival="gamma", cv=cv)
        gaps = [b.arrival_s - a.arrival_s for a, b in zip(t, t[1:])]
        assert statistics.mean(gaps) == pytest.approx(0.1, rel=0.1)
        assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(cv, rel=0.15)
    with pytest.raises(ValueError, match="sets its own arrivals"):
        traces.generate("spike", 0, None, 2.0)


def test_token_ids_share_exactly_the_group_prefix():
    a = TraceRequest(arrival_s=0, prompt_tokens=50, output_tokens=1, prefix_group="g", prefix_tokens=32)
    b = TraceRequest(arrival_s=0, prompt_tokens=60, output_tokens=1, prefix_group="g", prefix_tokens=32)
    c = TraceRequest(arrival_s=0, prompt_tokens=60, output_tokens=1, prefix_group="h", prefix_tokens=32)
    ia, ib, ic = traces.token_ids(a, 0), traces.token_ids(b, 1), traces.token_ids(c, 2)
    assert len(ia) == 50 and len(ib) == 60
    assert ia[:32] == ib[:32] and ia[32] != ib[32]
    assert ia[0] != ic[0]
    plain = [traces.token_ids(TraceRequest(arrival_s=0, prompt_tokens=20, output_tokens=1), i) for i in range(3)]
    assert len({p[0] for p in plain}) == 3


def test_from_bench_keeps_send_times_and_drops_gates():
    reqs = workload.make("spike-overlap", 0)
    t = traces.from_bench(reqs, [0.1 * i for i in range(len(reqs))])
    assert [r.arrival_s for r in t] == pytest.approx([0.1 * i for i in range(len(reqs))])
    assert all(r.after_tokens == 0 and r.after_gate_s == 0 for r in t)
    assert [r.tag for r in t][-2:] == ["long-1", "long-2"]


def test_clock_time_arrivals_are_refused_naming_the_field(tmp_path):
    """Unix-timestamp arrival_s hung engine-sim, and once the clock could reach them every figure
    counted from 1970: 1.7e9 s of duration, throughput ~1e-8 tokens/s."""
    path = tmp_path / "epoch.jsonl"
    path.write_text('{"arrival_s": 1765000000.0, "prompt_tokens": 100, "output_tokens": 10}\n'
                    '{"arrival_s": 1765000001.5, "prompt_tokens": 100, "output_tokens": 10}\n')
    with pytest.raises(ValueError, match=r"arrival_s is the offset .* first request's is 1.765e\+09 s, a clock time"):
        traces.load(path)
    path.write_text('{"arrival_s": 86399, "prompt_tokens": 1, "output_tokens": 1}\n'
                    '{"arrival_s": 2e7, "prompt_tokens": 1, "output_tokens": 1}\n')
    assert len(traces.load(path)) == 2  # a late request is fine; it is the start that must be the run's
