#!/usr/bin/env bash
# Build llama.cpp's llama-server from the sources vendored in llama-cpp-python's source
# distribution, for `engine-bench --peer llama.cpp --llama-server PATH`.
#
#   examples/build_llama_server.sh [BUILD_DIR]     (default: ./llama-build, ~15 min on 2 cores)
#
# The binary ends in BUILD_DIR/build/bin/llama-server. Nothing in the test suite needs it.
# PIP and JOBS may be set in the environment (default: pip on PATH, all cores).
# LLAMA_CPU=avx2 builds for AVX2 + FMA only (no AVX-512 code at all), into BUILD_DIR/build-avx2:
# the llama.cpp half of the "AVX2-only CPU on an AVX-512 one" stand-in (README, GGUF weights).
set -euo pipefail

dir=${1:-llama-build}
pip=${PIP:-pip}
jobs=${JOBS:-$(nproc)}
case "${LLAMA_CPU:-native}" in
    native) out=build; isa=(-DGGML_NATIVE=ON) ;;
    avx2) out=build-avx2; isa=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF) ;;
    *) echo "LLAMA_CPU must be native or avx2, not '$LLAMA_CPU'" >&2; exit 2 ;;
esac
mkdir -p "$dir"
cd "$dir"

if ! ls llama_cpp_python-*.tar.gz >/dev/null 2>&1; then
    "$pip" download --no-binary :all: --no-deps -d . llama-cpp-python
fi
sdist=$(ls llama_cpp_python-*.tar.gz | head -n 1)
src=${sdist%.tar.gz}
[ -d "$src" ] || tar xzf "$sdist"

# The sdist vendors llama.cpp under vendor/llama.cpp; build only the server, CPU only.
# native (GGML_NATIVE=ON): the binary is for this machine, so llama.cpp tunes for its CPU.
nice -n 19 cmake -S "$src/vendor/llama.cpp" -B "$out" \
    -DCMAKE_BUILD_TYPE=Release "${isa[@]}" -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON
nice -n 19 cmake --build "$out" --target llama-server -j "$jobs"
echo "built: $(pwd)/$out/bin/llama-server"
