"""`engine-monitor --demo`: an Engine in this process under a built-in synthetic load.

The load mixes short chats (Poisson arrivals) with an occasional long prompt (1,500 tokens
every ~20 s by default), so that chunked prefill — or, under the continuous policy, the
stall a long prompt causes — shows up on the strip. The dashboard reads the engine's own
step stream and snapshot; nothing goes through HTTP.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import EngineDeadError
from engine.messages import StepRecord
from engine.request import SamplingParams
from monitor.source import EngineState, SourceRefused, SourceUnavailable, StepSource, describe_error

QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for writing clean Python.",
    "Explain what a KV cache is in one paragraph.",
    "Write a haiku about the sea.",
    "How do I reverse a list in Python?",
    "What causes the seasons on Earth?",
    "Summarise the plot of Romeo and Juliet.",
    "Why is the sky blue?",
    "Suggest a name for a small bakery.",
    "What is the difference between a process and a thread?",
    "Translate 'good morning' into Spanish and German.",
    "List five fruits that are rich in vitamin C.",
]


@dataclass(frozen=True)
class LoadSettings:
    chat_rate_per_s: float = 0.8  # Poisson arrivals of short chats
    chat_max_tokens: tuple[int, int] = (24, 128)
    long_first_s: float = 4.0  # the first long prompt comes early, so chunking is seen quickly
    long_every_s: float = 20.0
    long_prompt_tokens: int = 1500
    long_max_tokens: int = 32
    max_in_flight: int = 24  # arrivals pause while this many requests are in the engine
    seed: int = 0


class DemoLoad:
    """Keeps submitting requests to `engine` until cancelled; counts what happened to them."""

    def __init__(self, engine: Engine, settings: LoadSettings):
        self.engine = engine
        self.settings = settings
        self.submitted = 0
        self.refused = 0
        self._tasks: set[asyncio.Task] = set()

    async def run(self) -> None:
        s = self.settings
        rng = random.Random(s.seed)
        loop = asyncio.get_running_loop()
        next_long = loop.time() + s.long_first_s
        try:
            while True:
                if loop.time() >= next_long:
                    self._spawn(self._long(rng))
                    next_long += s.long_every_s
                if len(self._tasks) < s.max_in_flight:
                    self._spawn(self._chat(rng))
                gap = rng.expovariate(s.chat_rate_per_s) if s.chat_rate_per_s > 0 else s.long_every_s
                await asyncio.sleep(max(0.0, min(gap, next_long - loop.time())))
        finally:
            for t in self._tasks:
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(self._consume(coro))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _consume(self, outputs: AsyncIterator) -> None:
        self.submitted += 1
        try:
            async for _ in outputs:
                pass
        except EngineDeadError:
            pass
        except Exception:  # noqa: BLE001 - refused (queue full, too long): the load carries on
            self.refused += 1

    def _chat(self, rng: random.Random) -> AsyncIterator:
        s = self.settings
        params = SamplingParams(max_tokens=rng.randint(*s.chat_max_tokens), temperature=0.8, seed=rng.randrange(2**31))
        question = rng.choice(QUESTIONS)
        if getattr(self.engine.tokenizer, "chat_template", None):
            return self.engine.generate(messages=[{"role": "user", "content": question}], params=params)
        return self.engine.generate(question, params)

    def _long(self, rng: random.Random) -> AsyncIterator:
        s = self.settings
        vocab = len(self.engine.tokenizer)
        limit = getattr(self.engine, "max_model_len", s.long_prompt_tokens + s.long_max_tokens + 1)
        n = max(1, min(s.long_prompt_tokens, limit - s.long_max_tokens - 1))
        lo = min(200, vocab // 2)  # skip the special tokens at the start of the vocabulary
        # random ids: every long prompt is new, so the prefix cache cannot hide its prefill
        ids = [rng.randrange(lo, vocab) for _ in range(n)]
        params = SamplingParams(max_tokens=s.long_max_tokens, temperature=0.8, seed=rng.randrange(2**31))
        return self.engine.generate(ids, params)


class EngineSource(StepSource):
    """Starts an Engine on first connect (and again if it died) and drives it with DemoLoad."""

    connecting_activity = "starting the engine (loading the model)"

    def __init__(self, config: EngineConfig, *, load: LoadSettings | None = LoadSettings(), loaded=None):
        self.config = config
        self.load_settings = load
        self._loaded = loaded  # an already loaded model (tests)
        self.engine: Engine | None = None
        self.load: DemoLoad | None = None
        self._load_task: asyncio.Task | None = None
        self.description = "embedded engine (--demo)"

    async def connect(self) -> None:
        if self.engine is not None and not self.engine.dead:
            return
        await self._stop_engine()
        engine = Engine(self.config, loaded=self._loaded)
        try:
            await engine.start()
        except Exception as e:  # noqa: BLE001
            await engine.stop()
            # a model or config it cannot load: starting again would fail the same way
            raise SourceRefused(f"the engine failed to start: {describe_error(e)}") from None
        self.engine = engine
        if self.load_settings is not None:
            self.load = DemoLoad(engine, self.load_settings)
            self._load_task = asyncio.create_task(self.load.run(), name="monitor-demo-load")

    async def steps(self) -> AsyncIterator[StepRecord]:
        engine = self.engine
        if engine is None:
            raise SourceUnavailable("the engine is not running")
        async for record in engine.steps():
            yield record
        raise SourceUnavailable(f"the engine stopped: {engine.dead or 'no reason given'}")

    async def state(self) -> EngineState | None:
        if self.engine is None:
            return None
        if self.engine.dead:  # steps() may wait forever on a crashed engine: report it here
            raise SourceUnavailable(f"the engine stopped: {self.engine.dead}")
        if not self.engine.ready:
            return None
        return EngineState(snapshot=self.engine.snapshot(), config=self.config.to_dict())

    async def close(self) -> None:
        await self._stop_engine()

    async def _stop_engine(self) -> None:
        if self._load_task is not None:
            self._load_task.cancel()
            await asyncio.gather(self._load_task, return_exceptions=True)
            self._load_task = None
        if self.engine is not None:
            engine, self.engine = self.engine, None
            await engine.stop()
