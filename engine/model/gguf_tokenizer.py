"""A GGUF's tokenizer, saved beside its converted weights, checked to tokenize as the file's own.

transformers builds a GGUF's tokenizer from the file's vocabulary (`from_pretrained(gguf_file=)`).
Saved and loaded again, the class that tokenizer_config.json names (GemmaTokenizer,
Qwen2Tokenizer) rebuilds its normalizer and pre-tokenizer from the family's defaults rather than
from tokenizer.json, so a file whose vocabulary is not its family's usual one (a byte-level BPE in
a Gemma file, another pre-tokenizer in a Qwen file) would tokenize differently: a Gemma file's
spaces all became <unk>. So the saved tokenizer is compared with the file's on probe texts; where
they differ it is saved as the plain tokenizer.json (`PreTrainedTokenizerFast`, which
`open_tokenizer` loads as such: AutoTokenizer would let config.json's model_type pick the family's
class again) and compared again; a tokenizer that still differs is refused.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerFast

PLAIN = "PreTrainedTokenizerFast"

PROBES = (
    "The capital of France is",
    "Hello  world\n\n  two spaces,\ta tab, and an indented line",
    "def f(n):\n    return n ** 2  # 1234567890",
    "Ünïcödé: naïve café, 中文, русский, emoji 🙂",
    " leading and trailing spaces ",
)


class TokenizerMismatch(ValueError):
    """The saved tokenizer does not tokenize as the GGUF's own."""


def save_tokenizer(tokenizer, out: Path, name: str) -> None:
    """Save `tokenizer` (as read from the GGUF `name`) into `out`, such that loading `out`
    tokenizes and decodes every probe exactly as `tokenizer` does."""
    tokenizer.save_pretrained(out)
    if _same(tokenizer, out):
        return
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    named = config.get("tokenizer_class")
    config["tokenizer_class"] = PLAIN  # tokenizer.json as it is
    config_path.write_text(json.dumps(config, indent=2))
    if not _same(tokenizer, out):
        raise TokenizerMismatch(f"{name}: its tokenizer, saved and loaded again, does not tokenize as transformers "
                                f"reads it from the file (neither as {named} nor as plain tokenizer.json)")
    print(f"[stepwise] {name}: its vocabulary does not fit {named}; the converted tokenizer is its plain "
          "tokenizer.json", file=sys.stderr)


def open_tokenizer(path: Path):
    """The tokenizer of a Hugging Face directory: its plain tokenizer.json where its
    tokenizer_config.json says so, else what AutoTokenizer picks."""
    config_path = path / "tokenizer_config.json"
    if config_path.is_file() and json.loads(config_path.read_text()).get("tokenizer_class") == PLAIN:
        return PreTrainedTokenizerFast.from_pretrained(str(path))
    return AutoTokenizer.from_pretrained(str(path))


def _same(tokenizer, out: Path) -> bool:
    try:
        saved = open_tokenizer(out)
        for text in (*PROBES, *tokenizer.all_special_tokens):
            ids = tokenizer(text).input_ids
            if saved(text).input_ids != ids or saved.decode(ids) != tokenizer.decode(ids):
                return False
    except Exception:  # the named class cannot read this vocabulary (e.g. no <unk> in it)
        return False
    return True
