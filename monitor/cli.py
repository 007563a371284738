"""engine-monitor: a terminal dashboard of what the engine does, step by step.

    engine-monitor                                 # attach to http://127.0.0.1:8000
    engine-monitor --url http://host:8000 [--api-key KEY] [--replica replica-1]
    engine-monitor --demo [--policy chunked|continuous|static] [--model smollm2-135m]
"""

from __future__ import annotations

import argparse
import sys

from engine.config import POLICIES

DEFAULT_URL = "http://127.0.0.1:8000"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="engine-monitor", description=__doc__.split("\n\n")[0].split(": ", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group()
    where.add_argument("--url", help=f"a running engine-serve to attach to (default {DEFAULT_URL})")
    where.add_argument("--demo", action="store_true",
                       help="run an engine in this process under a synthetic load (no server needed)")
    p.add_argument("--api-key", default="", help="bearer token, if the server wants one")
    p.add_argument("--replica", help="a cluster (engine-serve --replicas N): the replica to show first "
                                     "(default its first; the r key goes to the next)")
    demo = p.add_argument_group("--demo options")
    demo.add_argument("--config", default=None, help="config file (default: ./config.toml if present, else built-in)")
    demo.add_argument("--policy", choices=POLICIES, help="scheduling policy (default: the config's)")
    demo.add_argument("--model", help="model spec (default: the config's, smollm2-135m)")
    demo.add_argument("--chat-rate", type=float, default=0.8, help="short chats per second (default 0.8)")
    demo.add_argument("--long-every", type=float, default=20.0, help="seconds between long prompts (default 20)")
    demo.add_argument("--long-tokens", type=int, default=1500, help="tokens in a long prompt (default 1500)")
    return p


def make_source(args: argparse.Namespace, *, loaded=None):
    if args.demo:
        from engine.config import EngineConfig, config_path
        from monitor.demo import EngineSource, LoadSettings

        path = config_path(args.config)
        overrides = {k: v for k, v in (("policy", args.policy), ("model", args.model)) if v}
        config = EngineConfig.load(path, **overrides)
        load = LoadSettings(chat_rate_per_s=args.chat_rate, long_every_s=args.long_every,
                            long_prompt_tokens=args.long_tokens)
        return EngineSource(config, load=load, loaded=loaded)
    from monitor.http_source import HttpSource

    return HttpSource(args.url or DEFAULT_URL, api_key=args.api_key, replica=args.replica)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.demo:
        used = [f"--{n.replace('_', '-')}" for n in ("config", "policy", "model") if getattr(args, n)]
        if used:
            parser.error(f"{', '.join(used)} only apply with --demo")
    elif args.replica:
        parser.error("--replica only applies with --url")
    try:
        source = make_source(args)
    except (ValueError, OSError) as e:  # a bad config file or value: say so, no traceback
        print(f"engine-monitor: {e}", file=sys.stderr)
        return 2

    from monitor.app import MonitorApp

    MonitorApp(source).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
