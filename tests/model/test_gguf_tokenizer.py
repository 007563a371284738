"""A GGUF's converted tokenizer tokenizes as transformers reads it from the file: kept as its
class where that round-trips, saved as plain tokenizer.json where the class rebuilds it wrongly,
refused where neither does."""

from __future__ import annotations

import json

import pytest

from engine.model.gguf_tokenizer import PLAIN, PROBES, TokenizerMismatch, open_tokenizer, save_tokenizer
from engine.model.tiny import tiny_tokenizer


class Saved:
    """A tokenizer read from a file whose saved form `edit` changes (as a family class would
    rebuild it), to check what save_tokenizer makes of it."""

    def __init__(self, edit):
        self.tokenizer = tiny_tokenizer()
        self.edit = edit

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def __call__(self, text):
        return self.tokenizer(text)

    def save_pretrained(self, out):
        self.tokenizer.save_pretrained(out)
        self.edit(out)


def _tokenizer_class(out, name):
    path = out / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "tokenizer_class": name}))


def _lowercase(out):
    path = out / "tokenizer.json"
    spec = json.loads(path.read_text())
    spec["normalizer"] = {"type": "Lowercase"}
    path.write_text(json.dumps(spec))


def _assert_same(tokenizer, out):
    saved = open_tokenizer(out)
    for text in PROBES:
        assert saved(text).input_ids == tokenizer(text).input_ids, text


def test_a_tokenizer_that_round_trips_keeps_its_class(tmp_path, capsys):
    tokenizer = tiny_tokenizer()
    save_tokenizer(tokenizer, tmp_path, "tiny.gguf")
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["tokenizer_class"] != PLAIN
    assert "does not fit" not in capsys.readouterr().err
    _assert_same(tokenizer, tmp_path)


def test_a_class_that_cannot_read_the_vocabulary_gives_way_to_plain_tokenizer_json(tmp_path, capsys):
    """What a Gemma file with a byte-level BPE vocabulary did: GemmaTokenizer rebuilt it (every
    space became <unk>); here GemmaTokenizer cannot read the tiny vocabulary at all."""
    tokenizer = Saved(lambda out: _tokenizer_class(out, "GemmaTokenizer"))
    save_tokenizer(tokenizer, tmp_path, "odd.gguf")
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["tokenizer_class"] == PLAIN
    assert "odd.gguf: its vocabulary does not fit GemmaTokenizer" in capsys.readouterr().err
    _assert_same(tokenizer, tmp_path)


def test_a_plain_tokenizer_is_opened_as_such_beside_a_config_naming_a_family(tmp_path):
    """AutoTokenizer lets config.json's model_type pick the family's class over tokenizer_config."""
    tokenizer = Saved(lambda out: _tokenizer_class(out, PLAIN))
    save_tokenizer(tokenizer, tmp_path, "odd.gguf")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}))
    assert type(open_tokenizer(tmp_path)).__name__ in ("PreTrainedTokenizerFast", "TokenizersBackend")
    _assert_same(tokenizer, tmp_path)


def test_a_tokenizer_that_cannot_be_saved_faithfully_is_refused(tmp_path):
    with pytest.raises(TokenizerMismatch, match="bad.gguf: its tokenizer, saved and loaded again, does not tokenize"):
        save_tokenizer(Saved(_lowercase), tmp_path, "bad.gguf")
