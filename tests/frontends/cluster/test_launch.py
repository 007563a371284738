"""Replicas' start-up checks (frontends/cluster/launch.py) that need no running Ray: what would
have hung silently — an address where nothing answers, resources the cluster lacks — is
refused at once, naming the flags; a deployment's failure carries Serve's reason."""

from __future__ import annotations

import socket
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("ray", reason="Ray Serve is not installed (pip install -e '.[ray]')")

from frontends.cluster import launch  # noqa: E402
from tests.frontends.conftest import tiny_config  # noqa: E402


def test_an_address_where_nothing_answers_is_refused_at_once():
    """ray.init retried it for minutes ("Timed out while waiting for GCS"), never erring."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        start = time.monotonic()
        for address in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}"):
            with pytest.raises(ConnectionError, match="nothing answers there"):
                launch._check_reachable(address)
    assert time.monotonic() - start < 10


def test_auto_is_checked_where_ray_finds_it(tmp_path, monkeypatch):
    """A stale record of the node's last cluster sent "auto" to an address that never answered:
    engine-serve logged GCS timeouts every 30 s for ever, deaf to SIGINT and SIGTERM."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    (tmp_path / "ray").mkdir()
    with pytest.raises(ConnectionError, match="Could not find any running Ray instance"):
        launch._check_reachable("auto")  # no cluster ever started here
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))  # Ray resolves 127.0.0.1 to the node's own address
        port = s.getsockname()[1]
        (tmp_path / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{port}")
        with pytest.raises(ConnectionError, match=rf"at 'auto' \([0-9.]+:{port}: .*nothing answers there"):
            launch._check_reachable("auto")
        s.listen()
        launch._check_reachable("auto")  # a cluster that answers
        for env in (f"ray://127.0.0.1:{port}", f"127.0.0.1:{port}"):  # RAY_ADDRESS first, in any form ray.init takes
            monkeypatch.setenv("RAY_ADDRESS", env)
            launch._check_reachable("auto")
    monkeypatch.setenv("RAY_ADDRESS", f"ray://127.0.0.1:{port}")  # its socket is closed now
    with pytest.raises(ConnectionError, match=rf"'auto' \(ray://127.0.0.1:{port}: from RAY_ADDRESS\).*nothing answers"):
        launch._check_reachable("auto")


def test_resources_the_cluster_lacks_are_refused_on_a_local_ray_and_warned_of_on_a_shared_one(monkeypatch, capsys):
    """Serve waited for them for ever, logging nothing (and the first SIGTERM went unheard)."""
    monkeypatch.setattr(launch.ray, "cluster_resources", lambda: {"CPU": 1.0})
    config = tiny_config(replicas=2, replica_cpus=1.0, replica_gpus=0.5)
    with pytest.raises(ValueError, match=r"2 x 1 = 2 CPUs \(--replica-cpus\), it has 1; 2 x 0.5 = 1 GPUs"):
        launch._check_resources(config, started_ray=True)
    launch._check_resources(config, started_ray=False)  # an autoscaler may add them
    assert "warning: the 2 replicas need more" in capsys.readouterr().err
    launch._check_resources(tiny_config(replicas=1, replica_cpus=1.0), started_ray=True)  # enough


def test_a_failed_deployment_names_serves_reason(monkeypatch):
    """Only "Failed to update the deployments ['replica-0']" was shown; the cause was in Ray's logs."""
    why = ("The deployment failed to start 3 times in a row. ... Error:\nTraceback (most recent call last):\n"
           '  File "engine.py", line 93, in _start\n'
           "ValueError: device 'cuda': this torch sees no CUDA device\n")
    app = SimpleNamespace(deployments={"replica-0": SimpleNamespace(message=why)})
    monkeypatch.setattr(launch.serve, "status", lambda: SimpleNamespace(applications={"replica-0": app}))
    assert launch._deployment_errors(["replica-0", "replica-1"]) == (
        "replica-0: ValueError: device 'cuda': this torch sees no CUDA device")


def test_a_malformed_ray_address_is_refused_naming_the_key():
    """`--ray-address foo` ended in ray.init's traceback (ValueError: Invalid address format)."""
    import ray

    if ray.is_initialized():
        pytest.skip("Ray is already initialised in this process: connect would not call ray.init")
    with pytest.raises(ConnectionError, match=r"\[cluster\] ray_address 'foo': .*give \"auto\", host:port"):
        launch.Replicas.connect(tiny_config(replicas=1, ray_address="foo"))
    assert not ray.is_initialized()
