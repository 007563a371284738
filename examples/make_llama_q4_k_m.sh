#!/usr/bin/env bash
# A Llama-family GGUF in Q4_K_M, the layout most users' Llama files have, made here because no
# model hub is reachable: a randomly initialised 185M-parameter Llama (hidden 1024, 12 layers,
# 16 heads, 4 KV heads, SwiGLU 2816, SmolLM2's tokenizer) converted by llama.cpp's own
# convert_hf_to_gguf.py, then quantized by its llama-quantize (Q4_K q/k/o/gate/up, Q6_K v and
# down in half the layers, a Q6_K tied embedding). Its text is noise; its speed is a Llama
# Q4_K_M's (README, "A Llama Q4_K_M file").
#
#   examples/make_llama_q4_k_m.sh [BUILD_DIR] [OUT_DIR]
#
# BUILD_DIR: where examples/build_llama_server.sh unpacked and built llama.cpp (default
# ./llama-build; llama-quantize is built there if missing). OUT_DIR (default ./llama-q4km)
# gets llama185m-Q4_K_M.gguf. Run it with Stepwise's virtualenv active (torch, transformers).
set -euo pipefail

build=$(cd "${1:-llama-build}" && pwd)
out=${2:-llama-q4km}
src=$(ls -d "$build"/llama_cpp_python-*/vendor/llama.cpp | head -n 1)
mkdir -p "$out"
cd "$out"

[ -x "$build/build/bin/llama-quantize" ] ||
    nice -n 19 cmake --build "$build/build" --target llama-quantize -j "${JOBS:-$(nproc)}"

python - <<'EOF'
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine.config import ModelConfig
from engine.model.loader import load_tokenizer

tokenizer = load_tokenizer("smollm2-135m", ModelConfig().resolved_cache_dir())
config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
                     num_attention_heads=16, num_key_value_heads=4, head_dim=64, max_position_embeddings=8192,
                     rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
                     bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
torch.manual_seed(0)
LlamaForCausalLM(config).half().save_pretrained("hf")
tokenizer.save_pretrained("hf")
EOF

# The converter tries a SentencePiece vocabulary first and only falls back to tokenizer.json
# when the tokenizer.model file is missing, not when the sentencepiece package is: a stand-in
# module lets it reach that fallback without installing sentencepiece.
mkdir -p shim
echo 'class SentencePieceProcessor: pass' > shim/sentencepiece.py
PYTHONPATH=shim python "$src/convert_hf_to_gguf.py" hf --outtype f16 --outfile llama185m-f16.gguf
"$build/build/bin/llama-quantize" llama185m-f16.gguf llama185m-Q4_K_M.gguf Q4_K_M > quantize.log
rm -rf shim llama185m-f16.gguf
echo "made: $(pwd)/llama185m-Q4_K_M.gguf"
