"""Simulation needs no torch, model or tokenizer: run it in a fresh interpreter and look."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, sys
from engine.sim import trace
from engine.sim.cli import main
from tests.sim.util import CAL
CAL.save(sys.argv[1] + "/cal.json")
main(["run", "--calibration", sys.argv[1] + "/cal.json", "--workload", "mixed", "--num-requests", "24",
      "--replicas", "2", "--router", "prefix-affinity", "--out", sys.argv[1], "--no-plots"])
print(json.dumps(sorted(m for m in ("torch", "transformers", "tokenizers") if m in sys.modules)))
"""


def test_simulating_imports_no_torch(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, env=env,
                         cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
    summary = json.loads((tmp_path / "results.json").read_text())
    assert summary["results"]["chunked"]["num_requests"] == 24


RESULT = """
import json, sys
from engine.sim import trace
from engine.sim.simulator import simulate
from tests.sim.util import CAL, config
tr = trace.generate("shared-prefix", 5, 80, 6.0)
r = simulate(tr, config(), CAL, replicas=3, router="prefix-affinity")
print(json.dumps([r.routed, r.duration_s, [t.token_times for t in r.timings]]))
"""


def test_same_result_whatever_the_hash_seed():
    """Nothing in the run depends on set or str-hash order (salted per process)."""
    outs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", RESULT], capture_output=True, text=True, env=env, cwd=REPO,
                             timeout=300)
        assert out.returncode == 0, out.stderr
        outs.append(out.stdout)
    assert outs[0] == outs[1]
