"""`engine-serve`: the OpenAI-compatible server from the command line.

Every config key has a flag (`--max-num-batched-tokens 512`, `--policy static`,
`--no-enable-prefix-caching`), built from `engine.config.all_keys()`; flags override
`--config PATH` (default ./config.toml when present, else built-in defaults).

HTTP comes up first and answers /health with 503 while the model loads in the background.
SIGINT / SIGTERM shut down cleanly: new requests get 503 (code shutting_down) and /health
503 at once; in-flight generations may finish for up to `--shutdown-grace-ms` ([server]
shutdown_grace_ms, default 5000); then the socket closes, what is left is aborted (a stream ends
with an error event and [DONE], a non-streamed request gets 503), handlers are waited for,
the engine stops, exit 0. A second signal exits at once.

`--replicas N` (N >= 1) serves N engine replicas on Ray Serve behind the same endpoint
instead (`frontends.cluster`, the `ray` extra); `--ray-address` joins an existing cluster.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import os
import signal
import sys
from collections.abc import Callable

from engine import Engine, EngineConfig
from engine.config import DEFAULT_CONFIG, all_keys, config_path
from frontends.http import HttpFrontend

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="engine-serve", description="Serve Stepwise over an OpenAI-compatible HTTP API.")
    parser.add_argument("--config", metavar="PATH", help=f"TOML config (default: ./{DEFAULT_CONFIG} if present)")
    parser.add_argument("--access-log", action="store_true", help="log every HTTP request")
    for key, (section, kind) in all_keys().items():
        flag = "--" + key.replace("_", "-")
        if kind is bool:
            parser.add_argument(flag, dest=key, action=argparse.BooleanOptionalAction, default=None,
                                help=f"[{section}] {key}")
        else:
            parser.add_argument(flag, dest=key, type=kind, default=None, metavar=kind.__name__.upper(),
                                help=f"[{section}] {key}")
    return parser


def load_config(args: argparse.Namespace) -> EngineConfig:
    path = config_path(args.config)
    overrides = {k: v for k, v in vars(args).items() if k in all_keys() and v is not None}
    return EngineConfig.load(path, **overrides)


def stop_on_signals(on_force: Callable[[], None] | None = None) -> asyncio.Event:
    """An event set by the first SIGINT / SIGTERM; a second one exits at once (after
    `on_force`: what must not outlive the process, such as a local Ray's agents)."""
    stop = asyncio.Event()

    def on_signal(signum: int) -> None:
        if stop.is_set():
            if on_force is not None:
                on_force()
            os._exit(128 + signum)
        print(f"\n[stepwise] {signal.Signals(signum).name}: shutting down (again to force)", file=sys.stderr)
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    return stop


async def serve(config: EngineConfig, access_log: bool = False) -> int:
    if config.cluster.replicas:
        from frontends.cluster.serve import serve_cluster  # needs the `ray` extra (checked in main)

        return await serve_cluster(config, stop_on_signals, access_log)
    stop = stop_on_signals()
    engine = Engine(config)
    frontend = HttpFrontend(access_log=access_log)
    try:
        await frontend.start(engine)
    except OSError as e:
        print(f"[stepwise] {e}", file=sys.stderr)
        return 1
    print(f"[stepwise] listening on {frontend.url} (loading {config.model.model}...)", file=sys.stderr)
    loading = asyncio.create_task(engine.start(), name="stepwise-load")
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait([loading, stopping], return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if loading.done() and loading.exception() is not None:
        print(f"[stepwise] failed to start the engine: {loading.exception()!r}", file=sys.stderr)
        code = 1
    elif loading.done():
        print(f"[stepwise] ready: {config.served_model_name}, policy {config.scheduler.policy}", file=sys.stderr)
        await stopping
    else:
        loading.cancel()
        await asyncio.wait([loading])
    stopping.cancel()
    await frontend.stop()
    await engine.stop()
    print("[stepwise] stopped", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = load_config(args)
    except (ValueError, OSError) as e:
        parser.error(str(e))
    if config.cluster.replicas and importlib.util.find_spec("ray") is None:
        parser.error("--replicas needs Ray Serve: install the extra with pip install -e '.[ray]'")
    if unread := config.cluster.unread_router_keys():
        parser.error(f"[cluster] {', '.join(unread)}: only the prefix router reads them, and router is "
                     f"{config.cluster.router!r} (set router = \"prefix\", or remove them)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return asyncio.run(serve(config, args.access_log))


if __name__ == "__main__":
    sys.exit(main())
