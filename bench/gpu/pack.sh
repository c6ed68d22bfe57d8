#!/usr/bin/env bash
# What a GPU device command needs, in .gpu/ (ignored; `carry: [".gpu"]`), all under the 64 MiB a command takes:
#   .gpu/build       a CUDA build made on the device by an earlier session (~/.cache/kvroute/gpu-build, 42 MiB: its
#                    libraries, llama-server, llama-batched-bench), when there is one; else
#   .gpu/llama.cpp   the llama.cpp vendored in the pinned llama-cpp-python sdist, without its models, docs, tests,
#                    examples and other backends' sources (30 MB), built there (about 200 s of device time)
#   .gpu/site        llama-cpp-python's Python package (ctypes; its lib/ is built on the device) with its dist-info
#   .gpu/whl         cp312 wheels of our dependencies that the device's image lacks
#   .gpu/model.gguf.xz  bench/gpu/shaped_model.py: the default model's shape, compressed
# Run from the repository root:  bash bench/gpu/pack.sh
set -euo pipefail
PY=.venv/bin/python
VER=$($PY -c 'from importlib.metadata import version; print(version("llama-cpp-python"))')
mkdir -p .gpu/whl .gpu/site
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >>.git/info/exclude
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

BUILT=${KVROUTE_GPU_BUILD:-$HOME/.cache/kvroute/gpu-build/build.tar.xz}
if [ -f "$BUILT" ]; then # both would not fit in one command's 64 MiB
  mkdir -p .gpu/build && cp "$BUILT" .gpu/build/ && rm -rf .gpu/llama.cpp
elif [ ! -f .gpu/llama.cpp/CMakeLists.txt ]; then
  $PY -m pip download -q --no-deps --no-binary :all: -d "$tmp" "llama-cpp-python==$VER"
  tar xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp"
  src=$(echo "$tmp"/llama_cpp_python-*/vendor/llama.cpp)
  rm -rf "$src"/{models,docs,media,benches,tests,examples,gguf-py,conversion,app,pocs,skills,ci,requirements,licenses}
  for b in "$src"/ggml/src/ggml-*/; do
    case $(basename "$b") in ggml-cpu|ggml-cuda|ggml-blas) ;; *) rm -rf "$b" ;; esac
  done
  rm -rf "$src"/tools/ui/{src,static,tests}
  mv "$src" .gpu/llama.cpp
fi

site=$($PY -c 'import llama_cpp, pathlib; print(pathlib.Path(llama_cpp.__file__).parent.parent)')
rm -rf .gpu/site/llama_cpp .gpu/site/llama_cpp_python-*.dist-info
cp -r "$site/llama_cpp" .gpu/site/
rm -rf .gpu/site/llama_cpp/lib .gpu/site/llama_cpp/__pycache__ .gpu/site/llama_cpp/*/__pycache__
cp -r "$site"/llama_cpp_python-"$VER".dist-info .gpu/site/

for req in pyzmq msgspec structlog starlette uvicorn httptools llguidance diskcache gguf; do
  pin=$($PY -m pip list --format freeze 2>/dev/null | grep -i "^$req==")
  ls .gpu/whl | grep -qi "^${req}-" || $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_26_x86_64 --platform manylinux_2_31_x86_64 -d .gpu/whl "$pin"
done

[ -f .gpu/model.gguf.xz ] || $PY -m bench.gpu.shaped_model .gpu/model.gguf.xz
du -sh .gpu/*; du -sh .gpu
