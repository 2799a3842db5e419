# The hetfed client image of one organization: the client runtime on a CUDA PyTorch base.
# Build: docker/build.sh (buildah), or `docker build -f docker/client.Dockerfile --build-arg BASE=... .`
# BASE must already hold torch (for example pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime, or the local
# CPU base docker/build.sh makes); the project is installed next to it and pip keeps that torch.
ARG BASE=pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime

# ---- builder: a virtual environment that sees the base's torch and adds the project
FROM ${BASE} AS builder
# Set by docker/build.sh only behind a TLS-inspecting proxy: the CA bundle pip must trust (mounted, never copied).
ARG PIP_CERT
WORKDIR /src
COPY pyproject.toml README.md ./
COPY proto ./proto
COPY services ./services
COPY clients ./clients
# The base's torch satisfies the client extra's torch requirement: nothing replaces it.
RUN python3 -c "import torch" \
    && python3 -m venv --system-site-packages /opt/hetfed \
    && /opt/hetfed/bin/pip install --no-cache-dir ".[client]" \
    && /opt/hetfed/bin/python -c "import hetfed.client.runtime"

# ---- runtime: the base plus that environment
FROM ${BASE}
ARG HETFED_UID=10001
LABEL org.opencontainers.image.title="hetfed-client" \
      org.opencontainers.image.description="hetfed client runtime of one organization (PyTorch)" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PATH=/opt/hetfed/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    MPLCONFIGDIR=/tmp/matplotlib
COPY --from=builder /opt/hetfed /opt/hetfed
# A numeric user, so Kubernetes' runAsNonRoot can verify it without reading /etc/passwd.
USER ${HETFED_UID}:${HETFED_UID}
WORKDIR /tmp
EXPOSE 9091
ENTRYPOINT ["hetfed"]
CMD ["client", "--config", "/etc/hetfed/config/client.toml"]
