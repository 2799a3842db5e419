# The hetfed aggregator image: numpy, gRPC, Prometheus and the Kubernetes client; never torch.
# Build: docker/build.sh (buildah), or `docker build -f docker/aggregator.Dockerfile --build-arg BASE=... .`
# BASE is any Debian-like image with python3 >= 3.11 and its venv module (python:3.11-slim-bookworm, or the
# local debootstrap base docker/build.sh makes).
ARG BASE=python:3.11-slim-bookworm

# ---- builder: the project and its dependencies as wheels
FROM ${BASE} AS builder
# Set by docker/build.sh only behind a TLS-inspecting proxy: the CA bundle pip must trust (mounted, never copied).
ARG PIP_CERT
WORKDIR /src
COPY pyproject.toml README.md ./
COPY proto ./proto
COPY services ./services
COPY clients ./clients
RUN python3 -m venv /opt/build \
    && /opt/build/bin/pip install --no-cache-dir "pip>=24" "setuptools>=77" "wheel>=0.43" \
    && /opt/build/bin/pip wheel --no-cache-dir --wheel-dir /wheels ".[kubernetes]"

# ---- runtime: installs only those wheels, no compiler, no network
FROM ${BASE}
ARG HETFED_UID=10001
LABEL org.opencontainers.image.title="hetfed-aggregator" \
      org.opencontainers.image.description="hetfed aggregator: gRPC round engine, numpy server halves, no torch" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PATH=/opt/hetfed/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
COPY --from=builder /wheels /tmp/wheels
RUN python3 -m venv /opt/hetfed \
    && /opt/hetfed/bin/pip install --no-cache-dir --no-index --find-links /tmp/wheels "hetfed[kubernetes]" \
    && rm -rf /tmp/wheels \
    && mkdir -p /var/lib/hetfed /etc/hetfed \
    && chown "${HETFED_UID}:${HETFED_UID}" /var/lib/hetfed
# A numeric user, so Kubernetes' runAsNonRoot can verify it without reading /etc/passwd.
USER ${HETFED_UID}:${HETFED_UID}
WORKDIR /var/lib/hetfed
EXPOSE 50051 9090 8081
ENTRYPOINT ["hetfed"]
CMD ["aggregator", "--config", "/etc/hetfed/config/aggregator.toml"]
