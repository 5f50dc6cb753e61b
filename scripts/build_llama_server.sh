#!/usr/bin/env bash
# Build llama.cpp's llama-server and llama-fit-params from the sources vendored in the installed
# llama-cpp-python's sdist (the same llama.cpp that localinfer runs), with this CPU's SIMD flags and the RPC
# backend, and print the path of the one asked for (llama-server by default):
#
#     python3 benchmarks/serve_peers.py --llama-server "$(scripts/build_llama_server.sh)"
#     python3 -m benchmarks.moe_fit_vs_llamacpp --llama-fit-params "$(scripts/build_llama_server.sh llama-fit-params)"
#
# llama-server is the peer that benchmarks/serve_peers.py measures localinfer serve against; llama-fit-params
# is llama.cpp's own `--fit` decision (common/fit.cpp) as a tool, which benchmarks/moe_fit_vs_llamacpp.py
# runs against `localinfer worker --mem SIZE` devices over RPC.  Both come from one CMake tree and one build.
#
# Offline after the sdist download; no web UI (-DLLAMA_USE_PREBUILT_UI=OFF keeps cmake from fetching its
# assets: run the server with --no-webui), no curl.  About 16 minutes on 2 cores the first time, then
# cached under ${LOCALINFER_CACHE:-~/.cache/localinfer}/llama-server-VERSION/build/bin; messages go to
# stderr; exit 1 if it cannot.
set -euo pipefail
cd "$(dirname "$0")/.."
want=${1:-llama-server}
targets=(llama-server llama-fit-params)
case " ${targets[*]} " in *" $want "*) ;; *)
    echo "build_llama_server: unknown tool $want (one of: ${targets[*]})" >&2; exit 1 ;;
esac
ver=$(python3 -c "import llama_cpp; print(llama_cpp.__version__)")
root=${LOCALINFER_CACHE:-$HOME/.cache/localinfer}/llama-server-$ver
missing=()
for t in "${targets[@]}"; do [ -x "$root/build/bin/$t" ] || missing+=("$t"); done
if [ ${#missing[@]} -eq 0 ]; then echo "$root/build/bin/$want"; exit 0; fi
command -v cmake >/dev/null || { echo "build_llama_server: cmake not found" >&2; exit 1; }
src=$(scripts/llama_sources.sh)
mkdir -p "$root"
echo "build_llama_server: building ${missing[*]} $ver (about 16 minutes on 2 cores; log in $root)" >&2
# shellcheck disable=SC2046  # the flags are words
cmake -S "$src/vendor/llama.cpp" -B "$root/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF $(python3 scripts/llama_cmake_args.py) >"$root/cmake.log" 2>&1 \
    || { echo "build_llama_server: cmake failed, see $root/cmake.log" >&2; exit 1; }
cmake --build "$root/build" --target "${missing[@]}" -j "$(nproc)" >"$root/build.log" 2>&1 \
    || { echo "build_llama_server: build failed, see $root/build.log" >&2; exit 1; }
for t in "${targets[@]}"; do
    [ -x "$root/build/bin/$t" ] || { echo "build_llama_server: no $t in $root/build/bin" >&2; exit 1; }
done
echo "$root/build/bin/$want"
