"""Use the engine as an async library: stream a chat reply and watch the batch steps.

    .venv/bin/python examples/generate.py "What is continuous batching?" --policy chunked
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from engine import Engine, EngineConfig, SamplingParams
from engine.cli_args import positive_int

ROOT = Path(__file__).resolve().parent.parent


async def main(question: str, policy: str, max_tokens: int) -> None:
    config = EngineConfig.load(ROOT / "config.toml", policy=policy)
    async with Engine(config) as engine:
        steps, request_id = [], "example"

        async def watch() -> None:  # every step up to the one that lists the request as finished
            async for record in engine.steps():
                steps.append(record)
                if any(f.request_id == request_id for f in record.finished):
                    return

        watcher = asyncio.create_task(watch())
        await asyncio.sleep(0)  # the watcher subscribes before the request arrives
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        await engine.submit(messages=[{"role": "user", "content": question}], params=params, request_id=request_id)
        async for out in engine.stream(request_id):
            print(out.text, end="", flush=True)
            if out.finished:
                print(f"\n[{out.finish_reason}: {out.num_prompt_tokens} prompt + {out.num_generated_tokens} generated tokens]")
        await asyncio.wait_for(watcher, 10)
        prefill = sum(s.num_prefill_tokens for s in steps)
        print(f"[{len(steps)} steps under {policy!r}: {prefill} prefill tokens, then one decode token per step]")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("question", nargs="?", default="Explain in two sentences why batching helps LLM serving.")
    p.add_argument("--policy", default="chunked", choices=["static", "continuous", "chunked"])
    p.add_argument("--max-tokens", type=positive_int, default=96)
    args = p.parse_args()
    asyncio.run(main(args.question, args.policy, args.max_tokens))
