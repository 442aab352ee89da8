# The cachetier image (sidecar and engine server): installed exactly as `make setup` installs
# a checkout, through scripts/setup.sh, into /opt/venv.
FROM python:3.11-slim

RUN apt-get update \
    && apt-get install -y --no-install-recommends make gcc g++ \
    && rm -rf /var/lib/apt/lists/*

# torch==2.13.0 exists as a CUDA build on PyPI and a CPU build (2.13.0+cpu) on PyTorch's CPU
# index; with both indexes pip takes the +cpu local version, so no CUDA wheels land here.
ENV PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1

WORKDIR /app
COPY pyproject.toml Makefile README.md ./
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
