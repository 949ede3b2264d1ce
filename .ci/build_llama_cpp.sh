#!/usr/bin/env bash
# Build llama.cpp's own benchmark tools, llama-bench and llama-batched-bench, from the llama.cpp source
# vendored in the llama-cpp-python sdist the project pins, so that `python -m enginelib.bench
# --llama-cpp-bin DIR` compares the engine with the very llama.cpp the in-process peer would run,
# at its best build for this CPU (and without Python between llama.cpp and the clock).
#
#   bash .ci/build_llama_cpp.sh                       # GGML_NATIVE=ON: every instruction this CPU has
#   bash .ci/build_llama_cpp.sh -DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON   # a chosen build
#
# Arguments are passed to CMake after the defaults, so they override them. Environment:
#   LLAMA_CPP_PYTHON_VERSION  the sdist to build (default: PINNED_VERSION in enginelib/bench/llama_cpp_native.py)
#   LLAMA_CPP_BUILD_DIR       where the source and build go (default: ~/.cache/enginelib/llama.cpp-<version>
#                             or a -<name> suffix from LLAMA_CPP_BUILD_NAME, e.g. "noamx", to keep several builds)
#   LLAMA_CPP_JOBS            parallel compile jobs (default: the number of CPUs)
# It prints the build's seconds, its ggml flags (from CMakeCache.txt) and the directory to pass as
# --llama-cpp-bin. Nothing is installed: the tools are statically linked into build/bin.
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
pin="$here/enginelib/bench/llama_cpp_native.py"
version=${LLAMA_CPP_PYTHON_VERSION:-$(sed -n 's/^PINNED_VERSION = "\(.*\)"/\1/p' "$pin")}
if [ -z "$version" ]; then
    echo "build_llama_cpp: no PINNED_VERSION in $pin; set LLAMA_CPP_PYTHON_VERSION" >&2
    exit 2
fi
cache=${ENGINELIB_CACHE:-$HOME/.cache/enginelib}
dir=${LLAMA_CPP_BUILD_DIR:-$cache/llama.cpp-$version${LLAMA_CPP_BUILD_NAME:+-$LLAMA_CPP_BUILD_NAME}}
jobs=${LLAMA_CPP_JOBS:-$(nproc 2>/dev/null || sysctl -n hw.ncpu)}
for tool in cmake c++ pip; do
    if ! command -v "$tool" >/dev/null; then
        echo "build_llama_cpp: '$tool' is missing (Debian/Ubuntu: apt-get install cmake g++ python3-pip)" >&2
        exit 2
    fi
done

start=$(date +%s)
mkdir -p "$dir"
src="$dir/llama_cpp_python-$version/vendor/llama.cpp"
if [ ! -f "$src/CMakeLists.txt" ]; then
    echo "build_llama_cpp: fetching the llama-cpp-python $version sdist" >&2
    pip download --quiet --no-binary :all: --no-deps --dest "$dir" "llama-cpp-python==$version"
    tar -xzf "$dir/llama_cpp_python-$version.tar.gz" -C "$dir"
fi
fetched=$(date +%s)

build="$dir/build"
step() {  # a step's output goes to its log (the compiler warns a lot); its last lines are shown if it fails
    local log=$1; shift
    if ! "$@" >"$log" 2>&1; then
        tail -n 30 "$log" >&2
        echo "build_llama_cpp: failed: $* (whole log: $log)" >&2
        exit 1
    fi
}
step "$dir/cmake.log" cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=ON "$@"
step "$dir/build.log" cmake --build "$build" --config Release -j "$jobs" --target llama-bench llama-batched-bench
end=$(date +%s)

# The options turned on (GGML_NATIVE either way), and the instruction-set flags ggml's CPU code was compiled with:
# with GGML_NATIVE=ON the per-ISA options stay OFF and -march=native picks them (the benchmark reports both).
flags=$(grep -E '^GGML_(NATIVE|AVX[A-Z0-9_]*|AMX[A-Z0-9_]*|FMA|F16C|BMI2|CPU_REPACK|OPENMP|LLAMAFILE):' \
    "$build/CMakeCache.txt" | sed 's/:[A-Z]*=/=/' | grep -E '^GGML_NATIVE=|=ON$' | tr '\n' ' ')
isa=$(sed -n 's/^CXX_FLAGS = //p' "$build/ggml/src/CMakeFiles/ggml-cpu.dir/flags.make" 2>/dev/null \
    | tr ' ' '\n' | grep -E '^-(march|mcpu|mtune)=|^-m(avx|fma|f16c|amx|sse|bmi|f16)' | tr '\n' ' ')
printf 'llama-cpp-python %s (vendored llama.cpp) built in %d s (%d s fetching the sdist, %d s compiling, %d jobs)\n' \
    "$version" $((end - start)) $((fetched - start)) $((end - fetched)) "$jobs"
echo "options: $flags"
echo "ggml-cpu compiled with: ${isa:-(no ISA flags found)}"
echo "tools: $build/bin  (python -m enginelib.bench --llama-cpp-bin $build/bin)"
