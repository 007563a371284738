"""Compiled grammars, one per distinct schema: compiled off the event loop (a large schema over
a 50k-token vocabulary takes tens of milliseconds; a pathological one, minutes), kept in an LRU
keyed by the schema's canonical JSON and bounded by count and bytes. Owned by the intake actor,
which turns a request's StructuredOutput into a fresh matcher before the request reaches the
scheduler.

Each compile runs on a daemon thread of its own, at most COMPILE_THREADS at once: xgrammar
cannot interrupt a compile, so one slow schema holds one of them (not every other schema). A
process that ends mid-compile waits for it at exit (saying so): exiting under xgrammar's C++
aborted the process ("terminate called without an active exception", exit 134).
"""

from __future__ import annotations

import asyncio
import atexit
import re
import sys
import threading
from collections import OrderedDict

import xgrammar as xgr

from engine.errors import RequestError
from engine.structured.schema_fix import json_schema_grammar
from engine.structured.spec import StructuredOutput
from engine.torch_thread import in_passing_thread

DEFAULT_CACHE_SIZE = 256  # compiled grammars kept (each holds per-token masks: ~tens of KiB to MiB) ...
DEFAULT_CACHE_BYTES = 512 << 20  # ... and at most this many bytes of them (a 20,000-value enum takes ~80 MB)
COMPILE_THREADS = 2
_NATIVE_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")  # "[10:42:33] /project/cpp/x.cc:5082: "
_compiling = 0  # compiles running now, on any cache's threads (guarded by _compiled_cv)
_compiled_cv = threading.Condition()


@atexit.register
def _wait_for_compiles() -> None:
    with _compiled_cv:
        if _compiling:
            print(f"[stepwise] waiting for {_compiling} JSON schema compile(s) to end before exiting "
                  "(xgrammar cannot interrupt one)", file=sys.stderr)
        _compiled_cv.wait_for(lambda: _compiling == 0)


class GrammarCache:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: frozenset[int], max_size: int = DEFAULT_CACHE_SIZE,
                 max_bytes: int = DEFAULT_CACHE_BYTES):
        """vocab_size: the width of the model's logits, which may exceed len(tokenizer) (padded
        embeddings): the extra ids are never allowed by a mask."""
        self.tokenizer = tokenizer
        self.vocab_size = max(vocab_size, len(tokenizer))
        self.stop_token_ids = sorted(stop_token_ids)
        self.max_size = max_size
        self.max_bytes = max_bytes
        self.num_bytes = 0  # the kept grammars' memory_size_bytes
        self.num_hits = 0
        self.num_misses = 0
        self._compiled: OrderedDict[str, xgr.CompiledGrammar] = OrderedDict()
        self._pending: dict[str, asyncio.Future] = {}  # schemas being compiled now (one compile each)
        self._compiler: xgr.GrammarCompiler | None = None  # built on first use (reads the whole vocabulary)
        self._compiler_lock = threading.Lock()
        self._slots = asyncio.Semaphore(COMPILE_THREADS)

    def __len__(self) -> int:
        return len(self._compiled)

    async def get(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        """The compiled grammar of `spec`; RequestError (naming spec.param) if it cannot compile."""
        key = spec.cache_key
        compiled = self._compiled.get(key)
        if compiled is not None:
            self.num_hits += 1
            self._compiled.move_to_end(key)
            return compiled
        pending = self._pending.get(key)
        if pending is not None:  # the same schema is compiling for another request: share it
            self.num_hits += 1
            return await asyncio.shield(pending)
        self.num_misses += 1
        # kept by the compile's own task: a request aborted while it compiles (its caller
        # cancelled here) used to throw the result away, and the next one compiled it again
        pending = self._pending[key] = asyncio.ensure_future(self._compile_and_keep(key, spec))
        pending.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved, if nobody waits
        return await asyncio.shield(pending)

    async def _compile_and_keep(self, key: str, spec: StructuredOutput) -> xgr.CompiledGrammar:
        try:
            compiled = await self._compile_soon(spec)
        finally:
            self._pending.pop(key, None)
        self._compiled[key] = compiled
        self.num_bytes += compiled.memory_size_bytes
        # the newest is kept even alone over max_bytes: the request (and any same-schema one) uses it now
        while len(self._compiled) > 1 and (len(self._compiled) > self.max_size or self.num_bytes > self.max_bytes):
            self.num_bytes -= self._compiled.popitem(last=False)[1].memory_size_bytes
        return compiled

    def matcher(self, compiled: xgr.CompiledGrammar) -> xgr.GrammarMatcher:
        """A fresh per-request matcher: its state is the request's position in the grammar."""
        return xgr.GrammarMatcher(compiled)

    async def _compile_soon(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        async with self._slots:
            return await in_passing_thread(self._compile, spec)

    # --- compile threads ----------------------------------------------------------------

    def _compile(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        global _compiling
        with _compiled_cv:
            _compiling += 1
        try:
            return self._compile_counted(spec)
        finally:
            with _compiled_cv:
                _compiling -= 1
                _compiled_cv.notify_all()

    def _compile_counted(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        with self._compiler_lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids or None)
                # our own LRU decides what is kept; xgrammar's cache would keep a second copy
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        try:
            return self._compiler.compile_grammar(json_schema_grammar(spec.json_schema))
        except RuntimeError as e:
            reason = _NATIVE_PREFIX.sub("", str(e).strip().splitlines()[0] if str(e).strip() else "")
            raise RequestError(f"{spec.param}: the JSON schema is not supported or invalid: {reason}",
                               spec.param) from None
