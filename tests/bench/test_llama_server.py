"""The llama.cpp peer's process handling, with a stand-in binary (a small Python HTTP server
that answers /health): command line, start, health wait, stop, clear errors. The real
llama-server is never needed by the tests."""

from __future__ import annotations

import json
import sys
import urllib.request

import pytest

from engine.bench import cli, llama_server, workload

FAKE = """#!{python}
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
args = sys.argv[1:]
if "--fail" in open({argfile!r}.replace(".json", ".mode")).read():
    sys.exit(3)
json.dump(args, open({argfile!r}, "w"))
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *a):
        pass
HTTPServer(("127.0.0.1", int(args[args.index("--port") + 1])), H).serve_forever()
"""


@pytest.fixture
def fake_server(tmp_path):
    argfile = tmp_path / "args.json"
    (tmp_path / "args.mode").write_text("ok")
    script = tmp_path / "llama-server"
    script.write_text(FAKE.format(python=sys.executable, argfile=str(argfile)))
    script.chmod(0o755)
    return script, argfile


def test_server_runs_healthy_then_stops(tmp_path, fake_server):
    script, argfile = fake_server
    requests = workload.make("mixed", 0, 6, 0.0, 20000)
    longest = max(len(r.prompt_token_ids) + r.max_tokens for r in requests)
    with llama_server.llama_server(str(script), tmp_path / "m.gguf", 3, requests, 4, tmp_path / "log") as url:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
            assert resp.status == 200
        args = json.loads(argfile.read_text())
    assert args[args.index("-m") + 1] == str(tmp_path / "m.gguf")
    assert args[args.index("-t") + 1] == "3" and args[args.index("-np") + 1] == "4"  # 6 requests, at most 4 slots
    assert int(args[args.index("-c") + 1]) >= 4 * longest
    with pytest.raises(OSError):  # stopped
        urllib.request.urlopen(f"{url}/health", timeout=2)


def test_a_server_that_exits_is_reported(tmp_path, fake_server):
    script, _ = fake_server
    (tmp_path / "args.mode").write_text("--fail")
    with pytest.raises(RuntimeError, match="exited with code 3"):
        with llama_server.llama_server(str(script), tmp_path / "m.gguf", 1, workload.make("single"), 1, tmp_path / "log"):
            pass


def test_binary_is_required_and_must_exist(tmp_path):
    with pytest.raises(ValueError, match="--llama-server PATH"):
        llama_server.resolve_binary(None)
    with pytest.raises(ValueError, match="no such executable"):
        llama_server.resolve_binary(str(tmp_path / "missing"))


def test_cli_refuses_llama_cpp_without_binary_or_gguf(tmp_path, fake_server):
    with pytest.raises(SystemExit, match="--llama-server PATH"):
        cli.main(["--peer", "llama.cpp", "--no-plots", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="not a GGUF model"):
        cli.main(["--model", "tiny-random", "--peer", "llama.cpp", "--llama-server", str(fake_server[0]),
                  "--workload", "single", "--no-plots", "--out", str(tmp_path)])
