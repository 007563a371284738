"""Streaming text: deltas are whole characters (never U+FFFD) that add up to the decoded
tokens; stop strings — even split across tokens — end the text right before them and are
never sent, partial matches are held back until resolved.

Unit tests drive the Detokenizer with the tiny byte-level tokenizer (every UTF-8 byte is a
token, so a Chinese character is three); end-to-end tests stream the real model."""

from __future__ import annotations

import asyncio

import pytest

from engine import Engine, SamplingParams
from engine.detokenizer import Detokenizer
from engine.model.tiny import tiny_tokenizer
from tests.engine.util import greedy, real_config, run_request, tiny_config

FFFD = "\ufffd"


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def stream(tok, text: str, stop: list[str], prompt: str = "", **kw) -> tuple[list[str], Detokenizer]:
    """Push `text` token by token (bytes), taking a delta after each; the last take is final."""
    d = Detokenizer(tok, tok.encode(prompt, add_special_tokens=False), stop, **kw)
    ids = tok.encode(text, add_special_tokens=False)
    deltas = []
    for i, t in enumerate(ids):
        d.push(t)
        deltas.append(d.take(final=i == len(ids) - 1))
    return deltas, d


# --- detokenizer unit tests (tiny byte tokenizer) -------------------------------------------


def test_tiny_tokenizer_splits_chinese_into_bytes(tok):
    assert len(tok.encode("你好", add_special_tokens=False)) == 6
    assert tok.decode(tok.encode("你", add_special_tokens=False)[:2]).endswith(FFFD)


def test_multibyte_characters_are_released_whole(tok):
    text = "北京 is 中国的首都。ok"
    deltas, _ = stream(tok, text, [])
    assert "".join(deltas) == text
    assert not any(FFFD in d for d in deltas)
    # a 3-byte character: nothing after its first two bytes, the whole character after the third
    assert deltas[:3] == ["", "", "北"]


def test_stop_string_split_across_tokens(tok):
    deltas, d = stream(tok, "你好世界再见", ["世界"])  # "世界" is 6 byte tokens
    assert "".join(deltas) == "你好"
    assert d.hit_stop
    # "世" alone could start the stop string: it is held, never sent
    assert not any("世" in x for x in deltas)


def test_stop_string_cuts_everything_after_it(tok):
    d = Detokenizer(tok, [], ["STOP"])
    for t in tok.encode("abcSTOPdef", add_special_tokens=False):
        d.push(t)
    assert d.hit_stop and d.take(final=True) == "abc"


def test_partial_match_is_held_then_released_at_the_end(tok):
    deltas, d = stream(tok, "hello wor", ["world"])
    assert not d.hit_stop
    assert "".join(deltas[:-1]) == "hello "  # "wor" might become "world": held
    assert deltas[-1] == "wor"  # the final take releases it
    assert "".join(deltas) == "hello wor"


def test_partial_match_released_once_it_diverges(tok):
    d = Detokenizer(tok, [], ["world"])
    out = ""
    for t in tok.encode("hello wor", add_special_tokens=False):
        d.push(t)
        out += d.take()
    assert out == "hello "
    d.push(tok.encode("x", add_special_tokens=False)[0])
    assert d.take() == "worx"


def test_partial_match_of_a_multibyte_stop(tok):
    deltas, _ = stream(tok, "我爱北京天安门", ["北京大学"])
    assert "".join(deltas) == "我爱北京天安门"
    held = "".join(deltas[: len(tok.encode("我爱北京", add_special_tokens=False))])
    assert held == "我爱"  # "北京" is a prefix of the stop string: held until "天" rules it out


def test_first_completed_stop_wins_and_earliest_on_a_tie(tok):
    # checked token by token: "bc" completes before "abcd" could, so the text ends at "xa"
    deltas, _ = stream(tok, "xabcd", ["bc", "abcd"])
    assert "".join(deltas) == "xa"
    # both complete on the same token: the one starting earlier cuts
    deltas, _ = stream(tok, "xabc", ["c", "abc"])
    assert "".join(deltas) == "x"


def test_prompt_text_never_matches_a_stop(tok):
    deltas, d = stream(tok, "ld is round", ["world"], prompt="hello wor")
    assert not d.hit_stop and "".join(deltas) == "ld is round"


def test_stop_equal_to_the_whole_output(tok):
    deltas, d = stream(tok, "end", ["end"])
    assert d.hit_stop and "".join(deltas) == ""


# --- engine with the tiny model -------------------------------------------------------------


async def test_tiny_engine_stop_string_from_its_own_output(tiny_model):
    prompt = tiny_model.tokenizer.encode("Once upon a time", add_special_tokens=False)
    async with asyncio.timeout(30):
        async with Engine(tiny_config(policy="chunked"), loaded=tiny_model) as engine:
            free = await run_request(engine, prompt, greedy(30))
            text = free.text
            start = next(i for i in range(6, len(text) - 3) if FFFD not in text[i : i + 3])
            stop = text[start : start + 3]
            cut = await run_request(engine, prompt, greedy(30, stop=[stop]))
    assert cut.finish_reason == "stop"
    assert cut.text == text[: text.find(stop)]
    assert stop not in cut.text


@pytest.mark.parametrize("min_tokens,text", [(0, "ab"), (2, "ab"), (3, "ab\nc"), (5, "ab\nc\nd")])
def test_the_first_min_tokens_tokens_never_end_in_a_stop_string(tok, min_tokens, text):
    """As vLLM (its PR 22014): the 3rd token "\n" stopped a min_tokens=3 request, leaving
    visible text of fewer than min_tokens tokens."""
    deltas, d = stream(tok, "ab\nc\nd", ["\n"], min_tokens=min_tokens)
    assert "".join(deltas) == text


def test_a_stop_string_may_begin_within_min_tokens_and_end_after(tok):
    deltas, d = stream(tok, "axyz", ["xy"], min_tokens=2)  # "x" is the 2nd token, "y" the 3rd
    assert "".join(deltas) == "a" and d.hit_stop


def test_include_stop_str_in_output_keeps_the_stop_string(tok):
    deltas, d = stream(tok, "你好世界再见", ["世界"], include_stop=True)
    assert "".join(deltas) == "你好世界" and d.hit_stop


@pytest.mark.parametrize("include", [False, True])
async def test_a_stop_token_ends_the_text_before_its_own(tiny_model, include):
    """A stop_token_ids token's text was left in the output (vLLM leaves it out unless
    include_stop_str_in_output); its id stays in token_ids."""
    prompt = tiny_model.tokenizer.encode("Once upon a time", add_special_tokens=False)
    async with asyncio.timeout(60):
        async with Engine(tiny_config(policy="chunked"), loaded=tiny_model) as engine:
            free = await run_request(engine, prompt, greedy(30))
            ids = free.token_ids
            k = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i] and tiny_model.tokenizer.decode(ids[i]).isalnum())
            cut = await run_request(engine, prompt, greedy(30, stop_token_ids=[ids[k]], include_stop_str_in_output=include))
    assert cut.finish_reason == "stop" and cut.token_ids == ids[: k + 1]
    assert cut.text == tiny_model.tokenizer.decode(ids[: k + 1 if include else k])


# --- end to end on the real model -----------------------------------------------------------

QUESTION = [{"role": "user", "content": "你好！请用中文回答：中国的首都是哪里？"}]


async def stream_chat(engine, messages, **params):
    outputs = []
    async for out in engine.generate(messages=messages, params=SamplingParams(temperature=0.0, **params)):
        outputs.append(out)
    return outputs


@pytest.fixture(scope="module")
def chinese_greedy(real_model):
    async def go():
        async with Engine(real_config(policy="chunked"), loaded=real_model) as engine:
            return await stream_chat(engine, QUESTION, max_tokens=40)

    return asyncio.run(go())


@pytest.mark.real_model
def test_streamed_chinese_equals_decoded_tokens(real_model, chinese_greedy):
    outputs = chinese_greedy
    ids = [t for o in outputs for t in o.token_ids]
    text = "".join(o.text for o in outputs)
    assert outputs[-1].finished and outputs[-1].finish_reason in ("stop", "length")
    assert not any(FFFD in o.text for o in outputs)
    assert text == real_model.tokenizer.decode(ids, skip_special_tokens=True)
    assert sum("\u4e00" <= ch <= "\u9fff" for ch in text) >= 5, text  # it does answer in Chinese
    # and some character really spans several tokens (the held-back path is exercised)
    assert any(FFFD in real_model.tokenizer.decode([t]) for t in ids)


@pytest.mark.real_model
async def test_stop_string_spanning_tokens_on_the_real_model(real_model, chinese_greedy):
    tokenizer = real_model.tokenizer
    ids = [t for o in chinese_greedy for t in o.token_ids]
    full = "".join(o.text for o in chinese_greedy)
    # a 3-character stop string that starts one character before a token boundary
    stop = None
    for k in range(len(ids) // 3, len(ids) - 1):
        head = tokenizer.decode(ids[:k], skip_special_tokens=True)
        if not head or head.endswith(FFFD) or not full.startswith(head):
            continue
        b = len(head)
        candidate = full[b - 1 : b + 2]
        if len(candidate) == 3 and candidate.strip() == candidate and full.find(candidate) == b - 1:
            stop = candidate
            break
    assert stop, f"no usable stop string in {full!r}"
    async with asyncio.timeout(60):
        async with Engine(real_config(policy="chunked"), loaded=real_model) as engine:
            outputs = await stream_chat(engine, QUESTION, max_tokens=40, stop=[stop])
    text = "".join(o.text for o in outputs)
    assert outputs[-1].finish_reason == "stop"
    assert text == full[: full.index(stop)]
    assert stop not in text
    # the prefix streamed so far never contained it either, at any point
    so_far = ""
    for o in outputs:
        so_far += o.text
        assert stop not in so_far and FFFD not in o.text


@pytest.mark.real_model
async def test_character_cut_by_max_tokens_is_sent_as_fffd(real_model):
    """When max_tokens ends inside a multi-token character, the incomplete character is sent
    as U+FFFD, as decode() gives it (it used to be dropped silently)."""
    messages = [{"role": "user", "content": "请用中文介绍一下北京的历史。"}]
    tokenizer = real_model.tokenizer
    async with asyncio.timeout(60):
        async with Engine(real_config(policy="chunked"), loaded=real_model) as engine:
            long = await stream_chat(engine, messages, max_tokens=40, ignore_eos=True)
            ids = [t for o in long for t in o.token_ids]
            cuts = [n for n in range(20, len(ids)) if tokenizer.decode(ids[:n], skip_special_tokens=True).endswith(FFFD)]
            if not cuts:
                pytest.skip("no cut inside a character in this output")
            outputs = await stream_chat(engine, messages, max_tokens=cuts[0], ignore_eos=True)
    ids = [t for o in outputs for t in o.token_ids]
    decoded = tokenizer.decode(ids, skip_special_tokens=True)
    assert decoded.endswith(FFFD)
    text = "".join(o.text for o in outputs)
    assert text == decoded
