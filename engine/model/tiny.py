"""A tiny randomly initialised Llama and a byte-level tokenizer, built in memory.

Unit tests run the whole engine on this: no files, no downloads, a forward step in
milliseconds. The tokenizer maps every UTF-8 byte to one token, so a Chinese character spans
several tokens — exactly what incremental detokenization must handle.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    byte_chars = pre_tokenizers.ByteLevel.alphabet()  # 256 printable stand-ins for bytes
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in sorted(byte_chars):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_llama(seed: int = 0, num_layers: int = 2, vocab_size: int = 259, hidden_size: int = 64,
               intermediate_size: int = 128) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=0,
    )
    with torch.random.fork_rng(devices=[]):  # seeded here without touching the caller's random stream
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
        # Default init (std 0.02) makes a near-uniform next-token distribution where greedy
        # argmax ties are common; larger weights give decisive, reproducible greedy text.
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.normal_(0.0, 0.15)
    return model.eval()
