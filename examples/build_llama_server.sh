#!/usr/bin/env bash
# Build llama.cpp's llama-server from the sources vendored in llama-cpp-python's source
# distribution, for `engine-bench --peer llama.cpp --llama-server PATH`.
#
#   examples/build_llama_server.sh [BUILD_DIR]     (default: ./llama-build, ~15 min on 2 cores)
#
# The binary ends in BUILD_DIR/build/bin/llama-server. Nothing in the test suite needs it.
# PIP and JOBS may be set in the environment (default: pip on PATH, all cores).
set -euo pipefail

dir=${1:-llama-build}
pip=${PIP:-pip}
jobs=${JOBS:-$(nproc)}
mkdir -p "$dir"
cd "$dir"

if ! ls llama_cpp_python-*.tar.gz >/dev/null 2>&1; then
    "$pip" download --no-binary :all: --no-deps -d . llama-cpp-python
fi
sdist=$(ls llama_cpp_python-*.tar.gz | head -n 1)
src=${sdist%.tar.gz}
[ -d "$src" ] || tar xzf "$sdist"

# The sdist vendors llama.cpp under vendor/llama.cpp; build only the server, CPU only.
# GGML_NATIVE=ON: the binary is for this machine, so let llama.cpp tune for its CPU.
nice -n 19 cmake -S "$src/vendor/llama.cpp" -B build \
    -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON
nice -n 19 cmake --build build --target llama-server -j "$jobs"
echo "built: $(pwd)/build/bin/llama-server"
