#!/usr/bin/env bash
# Loom's device check (tools/gpu_check.py says what each stage does), in one command:
#   tools/gpu_check.sh                        on a lent GPU machine: `just gpu-pack` first, here,
#                                             and carry .gpu (wheels, SmolLM2's tokenizer)
#   tools/gpu_check.sh --device cpu --tiny    its dry run on the CPU, under a minute (CI runs it)
# Logs and figures go to $OUT (the device tool's folder), else ./gpu-check.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -x .venv/bin/python ]; then
    python=.venv/bin/python  # a checkout set up by `just setup`: everything is installed
else
    python=python3  # the GPU machine's (torch, Triton, transformers): the rest travels as wheels
    if compgen -G ".gpu/wheels/*.whl" >/dev/null; then
        "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/loom-site .gpu/wheels/*.whl
        export PYTHONPATH="/tmp/loom-site:$PYTHONPATH"
    fi
fi
"$python" -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__)'
exec "$python" tools/gpu_check.py "$@"
