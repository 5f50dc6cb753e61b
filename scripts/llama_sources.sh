#!/usr/bin/env bash
# Print the folder of the llama-cpp-python sdist matching the installed version, unpacked (its llama.cpp
# sources are under vendor/llama.cpp), downloading it the first time with pip.
#
# Cached under ${LOCALINFER_CACHE:-~/.cache/localinfer}/llama-src-VERSION; messages go to stderr; exit 1
# if it cannot (no llama-cpp-python installed, no network for the first download).
set -euo pipefail
ver=$(python3 -c "import llama_cpp; print(llama_cpp.__version__)" 2>/dev/null) \
    || { echo "llama_sources: llama-cpp-python is not installed (./install.sh)" >&2; exit 1; }
root=${LOCALINFER_CACHE:-$HOME/.cache/localinfer}/llama-src-$ver
if [ ! -d "$root/src" ]; then
    mkdir -p "$root"
    python3 -m pip download -q --disable-pip-version-check --no-binary :all: --no-deps -d "$root/dl" \
        "llama-cpp-python==$ver" >&2 \
        || { echo "llama_sources: could not download the llama-cpp-python $ver sdist" >&2; exit 1; }
    tmp=$(mktemp -d "$root/src.tmp.XXXXXX")
    tar -xzf "$root"/dl/llama_cpp_python-"$ver".tar.gz -C "$tmp" --strip-components 1
    # another build may have unpacked it meanwhile: keep that one (a plain mv would nest this copy inside it)
    mv -T "$tmp" "$root/src" 2>/dev/null || rm -rf "$tmp"
fi
echo "$root/src"
