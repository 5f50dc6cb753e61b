#!/usr/bin/env bash
# Build an AVX2-only libllama + libggml from the llama.cpp sources vendored in the installed
# llama-cpp-python's sdist, and print the folder holding them (for LLAMA_CPP_LIB_PATH).
#
# Why: the torch backend's llamacpp_rounding mode reproduces llama.cpp's x86 AVX2 kernels to the bit
# (cuda_backend/ggml_numerics.py); on a CPU with AVX-512 the installed build runs other kernels, so its
# exactness tests skip.  With this library they run there too:
#
#     LLAMA_CPP_LIB_PATH=$(scripts/build_avx2_llama.sh) python3 -m pytest tests/cuda_backend -k llamacpp_exact
#
# The build (target llama only, about 2 minutes on 2 cores) is cached under
# ${LOCALINFER_CACHE:-~/.cache/localinfer}/llama-avx2-VERSION; messages go to stderr; exit 1 if it cannot.
set -euo pipefail
cd "$(dirname "$0")/.."
ver=$(python3 -c "import llama_cpp; print(llama_cpp.__version__)")
root=${LOCALINFER_CACHE:-$HOME/.cache/localinfer}/llama-avx2-$ver
lib=$root/build/bin
if [ -e "$lib/libllama.so" ]; then echo "$lib"; exit 0; fi
command -v cmake >/dev/null || { echo "build_avx2_llama: cmake not found" >&2; exit 1; }
src=$(scripts/llama_sources.sh)
mkdir -p "$root"
# shellcheck disable=SC2046  # the flags are words
cmake -S "$src/vendor/llama.cpp" -B "$root/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_BUILD_TOOLS=OFF $(python3 scripts/llama_cmake_args.py --conservative) >"$root/cmake.log" 2>&1 \
    || { echo "build_avx2_llama: cmake failed, see $root/cmake.log" >&2; exit 1; }
cmake --build "$root/build" --target llama -j "$(nproc)" >"$root/build.log" 2>&1 \
    || { echo "build_avx2_llama: build failed, see $root/build.log" >&2; exit 1; }
[ -e "$lib/libllama.so" ] || { echo "build_avx2_llama: no libllama.so in $lib" >&2; exit 1; }
echo "$lib"
