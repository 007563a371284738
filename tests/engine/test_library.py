"""The engine as a library: what a caller gets wrong is refused at the call site, naming it,
and never reaches the actors; an engine starts once; loads and thread settings stay its own."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from engine import Engine, SamplingParams
from engine.errors import ContextLengthError, EngineDeadError, RequestError
from engine.model import loader
from engine.model.tiny import tiny_llama
from engine.request import Request
from tests.engine.util import greedy, run_request, tiny_config

# params a library caller can build (SamplingParams does no checks when constructed) that the
# HTTP API's typed decoding refuses: each must be refused at submit, naming its field
WRONGLY_TYPED = [
    ("seed", dict(seed=True, temperature=0.7)),  # used to crash the scheduler: the whole engine died
    ("seed", dict(seed=False, temperature=0.7)),
    ("top_k", dict(top_k=True, temperature=0.7)),  # used to fail every request of its step
    ("stop", dict(stop="answer")),  # used to stop at any of its characters
    ("stop", dict(stop=None)),
    ("stop_token_ids", dict(stop_token_ids=5)),
    ("stop_token_ids", dict(stop_token_ids=[True])),
    ("logit_bias", dict(logit_bias=None)),
    ("logit_bias", dict(logit_bias={True: 1.0})),
    ("structured_output", dict(structured_output={"type": "object"})),
    ("ignore_eos", dict(ignore_eos="no")),  # used to be read as true
    ("temperature", dict(temperature=True)),
    ("top_p", dict(top_p="0.5")),
]


async def test_wrongly_typed_params_are_refused_naming_the_field_and_harm_no_one():
    async with Engine(tiny_config(num_threads=1)) as engine:
        bystander = asyncio.create_task(run_request(engine, [5, 6, 7], greedy(40)))
        for field, kwargs in WRONGLY_TYPED:
            with pytest.raises(RequestError) as refused:
                await engine.submit([1, 2, 3], SamplingParams(max_tokens=4, **kwargs))
            assert refused.value.param == field, (kwargs, str(refused.value))
        with pytest.raises(RequestError, match="params must be a SamplingParams") as refused:
            await engine.submit([1, 2, 3], {"max_tokens": 4})
        assert refused.value.param == "params"
        result = await asyncio.wait_for(bystander, 60)
        assert result.finish_reason == "length" and len(result.token_ids) == 40
        assert (await run_request(engine, [1, 2, 3], SamplingParams(max_tokens=3, seed=7))).finish_reason == "length"
        assert not engine.dead


def test_well_typed_params_pass_the_type_check():
    import enum

    import numpy as np

    class Level(enum.IntEnum):
        HIGH = 1

    SamplingParams(temperature=1, top_p=1, logit_bias={5: 2}, stop=["a"], stop_token_ids=[3], seed=0).validate()
    # subclasses of float and int are the numbers they are (numpy.float64 used to pass, and must still)
    SamplingParams(temperature=np.float64(0.5), top_p=np.float64(0.9), priority=Level.HIGH).validate()


def test_a_seed_is_any_signed_64_bit_integer_as_in_vllm():
    """A negative seed (OpenAI takes any integer, vLLM the int64 range) used to be a 400."""
    for seed in (-1, -(2**63), 2**63 - 1):
        SamplingParams(seed=seed, temperature=1).validate()
        assert Request("r", [1], SamplingParams(seed=seed, temperature=1), None, None, 0).generator is not None
    for seed in (2**63, -(2**63) - 1):
        with pytest.raises(RequestError, match="64-bit") as refused:
            SamplingParams(seed=seed).validate()
        assert refused.value.param == "seed"


def test_min_tokens_is_refused_with_structured_output():
    """A JSON value complete before min_tokens left no token to sample: the request ran to the
    end, then failed with a 500."""
    from engine import StructuredOutput

    with pytest.raises(RequestError, match="min_tokens cannot be combined with structured output") as refused:
        SamplingParams(min_tokens=5, structured_output=StructuredOutput.from_schema({"type": "object"})).validate()
    assert refused.value.param == "min_tokens"
    SamplingParams(structured_output=StructuredOutput.from_schema({"type": "object"})).validate()


@pytest.mark.parametrize("request_id", ["", 5, b"id"])
async def test_a_request_id_must_be_a_non_empty_string(request_id):
    async with Engine(tiny_config(num_threads=1)) as engine:
        with pytest.raises(RequestError, match="request_id must be a non-empty string") as refused:
            await engine.submit([1, 2], greedy(2), request_id=request_id)
        assert refused.value.param == "request_id"


async def test_a_request_id_may_not_contain_the_choice_separator():
    """Choice i of an n > 1 request runs as ID#i: a caller's "a#1" collided with request "a"'s
    second choice, and whichever came second ended with an error instead of being refused."""
    async with Engine(tiny_config(num_threads=1)) as engine:
        with pytest.raises(RequestError, match=r"contains '#', which is reserved: choice i of an n > 1") as refused:
            await engine.submit([1, 2], greedy(2), request_id="a#1")
        assert refused.value.param == "request_id"
        rid = await engine.submit([1, 2], SamplingParams(n=2, max_tokens=2, temperature=0.0), request_id="a")
        finals = [out async for out in engine.stream(rid) if out.finished]
        assert sorted(f.index for f in finals) == [0, 1] and {f.finish_reason for f in finals} == {"length"}


async def test_a_second_reader_of_one_request_is_refused_not_left_waiting():
    async with Engine(tiny_config(num_threads=1)) as engine:
        rid = await engine.submit([1, 2, 3], greedy(30))
        first = engine.stream(rid)
        out = await anext(first)
        with pytest.raises(RequestError, match="already being read") as refused:
            await anext(engine.stream(rid))
        assert refused.value.param == "request_id"
        tokens = list(out.token_ids)
        async for out in first:
            tokens += out.token_ids
        assert out.finish_reason == "length" and len(tokens) == 30


async def test_an_engine_starts_once():
    engine = Engine(tiny_config(num_threads=1, calibrate_step_cost=False))
    with pytest.raises(EngineDeadError, match="not started"):
        engine.snapshot()
    with pytest.raises(EngineDeadError, match="not started"):
        engine.step_cost()
    await engine.start()
    threads = threading.active_count()
    with pytest.raises(RuntimeError, match="already started"):
        await engine.start()  # used to load a second model and leave the first actors orphaned
    assert threading.active_count() == threads
    start = time.monotonic()
    await engine.stop()
    assert time.monotonic() - start < 10  # the orphans used to hold stop for 2 x 30 s
    with pytest.raises(RuntimeError, match="has stopped; create a new Engine"):
        await engine.start()  # used to "start", then refuse every request with "engine stopped"
    with pytest.raises(EngineDeadError, match="engine stopped"):
        await anext(engine.stream("req-never"))


def test_an_engine_is_used_from_the_loop_it_was_started_on():
    """Used from a later asyncio.run, it said an actor "was cancelled", and stop() raised
    "Event loop is closed"."""
    engine = Engine(tiny_config(num_threads=1, calibrate_step_cost=False))
    asyncio.run(engine.start())  # this loop ends: its actors are cancelled with it

    async def later() -> None:
        for call in (engine.submit([3, 4], greedy(2)), engine.abort("req-x"), anext(engine.stream("req-x")),
                     anext(engine.steps())):  # steps() waited silently for ever
            with pytest.raises(RuntimeError, match="started on another event loop"):
                await call
        await engine.stop()  # nothing left to stop: no error

    asyncio.run(later())


async def test_a_failed_start_may_be_tried_again(monkeypatch):
    def failing(*args):
        raise OSError("disk unplugged")

    monkeypatch.setattr("engine.engine.load_model", failing)
    engine = Engine(tiny_config(num_threads=1, calibrate_step_cost=False))
    with pytest.raises(OSError, match="disk unplugged"):
        await engine.start()
    monkeypatch.undo()
    async with engine:
        assert (await run_request(engine, [1, 2], greedy(2))).finish_reason == "length"


async def test_num_threads_is_the_engines_own():
    caller = torch.get_num_threads()
    async with Engine(tiny_config(num_threads=1, calibrate_step_cost=False)) as one:
        loop = asyncio.get_running_loop()
        assert await loop.run_in_executor(one.executor._thread, torch.get_num_threads) == 1
        assert torch.get_num_threads() == caller  # set on the engine's thread, not the caller's
    async with Engine(tiny_config(num_threads=0, calibrate_step_cost=False)) as default:
        from engine.engine import DEFAULT_THREADS

        # 0 = torch's own default, not what the previous engine set
        assert await loop.run_in_executor(default.executor._thread, torch.get_num_threads) == DEFAULT_THREADS


def test_building_the_tiny_model_leaves_the_callers_random_stream_alone():
    torch.manual_seed(123)
    want = torch.rand(4)
    torch.manual_seed(123)
    tiny_llama()
    assert torch.equal(torch.rand(4), want)


def test_model_loads_run_one_at_a_time(monkeypatch, tmp_path):
    """transformers' loading is not thread-safe: two engines starting at once used to get a
    tied weight left on the meta device. Loads from several threads never overlap."""
    active, most = [0], [0]

    def slow_load(*args):
        active[0] += 1
        most[0] = max(most[0], active[0])
        time.sleep(0.05)
        active[0] -= 1

    monkeypatch.setattr(loader, "_load", slow_load)
    threads = [threading.Thread(target=loader.load_model, args=("tiny-random", tmp_path)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most[0] == 1


async def test_a_loaded_model_in_another_dtype_is_refused(tiny_model):
    """`loaded=` fp32 weights under dtype = "bfloat16" ran fp32 weights (with a bf16 KV cache),
    unlike a real bf16 engine; bf16 weights under "float32" failed every request."""
    with pytest.raises(ValueError, match=r"\[model\] dtype 'bfloat16', but the model passed as loaded= holds "
                                         r"float32 weights"):
        async with Engine(tiny_config(dtype="bfloat16", attention_backend="torch", linear_backend="torch"),
                          loaded=tiny_model):
            pass


async def test_a_prompt_longer_than_the_kv_pool_names_the_prompt():
    async with Engine(tiny_config(num_threads=1, num_blocks=4, block_size=16, calibrate_step_cost=False)) as engine:
        with pytest.raises(ContextLengthError, match="could never run") as refused:
            await engine.submit(list(range(3, 100)), greedy(1))  # 97 prompt tokens, a 64-token pool
        assert refused.value.param == "prompt"
        with pytest.raises(ContextLengthError, match="could never run") as refused:
            await engine.submit(list(range(3, 40)), greedy(40))
        assert refused.value.param == "max_tokens"


def test_a_program_ending_while_a_schema_compiles_exits_cleanly():
    """Its interpreter exited under xgrammar's C++ on the compile thread: SIGABRT (exit 134,
    "terminate called without an active exception") instead of 0."""
    import os
    import subprocess
    import sys

    from tests.engine.util import REPO

    program = (
        "import asyncio\n"
        "from engine import Engine, EngineDeadError, SamplingParams, StructuredOutput\n"
        "from tests.tiny import tiny_config\n"
        "SLOW = StructuredOutput.from_schema({'enum': [f'value-{i:05d}-' + 'x' * 20 for i in range(8000)]})\n"
        "async def main():\n"
        "    async with Engine(tiny_config(num_threads=1, calibrate_step_cost=False)) as engine:\n"
        "        task = asyncio.create_task(engine.submit([1, 2], SamplingParams(max_tokens=4, structured_output=SLOW)))\n"
        "        await asyncio.sleep(0.05)\n"
        "    try:\n"
        "        await task\n"
        "    except EngineDeadError:\n"
        "        pass\n"
        "asyncio.run(main())\n")
    done = subprocess.run([sys.executable, "-c", program], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.returncode, done.stderr[-500:])
    assert "waiting for 1 JSON schema compile(s) to end before exiting" in done.stderr
