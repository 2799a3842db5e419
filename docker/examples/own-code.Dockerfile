# An organization's own client image: hetfed's client image plus the organization's Python package (its
# model builders and data factories, referenced from the values as `model.builder` / `data.factory`).
# The build context is the organization's package folder (a pip-installable package: pyproject.toml), not
# the hetfed repository. Build with buildah on the store docker/build.sh fills, from the repository's root.
# BASE is the hetfed client image built there; --pull=never makes a missing one an error in that store
# rather than a pull from a registry named localhost:
#   store=build/images
#   buildah --root $store/root --runroot $store/run --storage-driver vfs \
#     bud --isolation chroot --layers=false --pull=never --build-arg BASE=localhost/hetfed-client:0.1.0 \
#     --build-arg CHECK=hetfed_example.models:resnet \
#     -f docker/examples/own-code.Dockerfile -t localhost/hetfed-client-example:0.1.0 examples/hetfed_example
# or `docker/build.sh example` for the example package. pip builds the package, so it reaches the package
# index; behind a TLS-inspecting proxy add the proxy's CA, mounted for the build only:
#     -v /path/to/proxy-ca.pem:/run/hetfed-build-ca.crt:ro --build-arg PIP_CERT=/run/hetfed-build-ca.crt
# The package is installed with --no-deps, so the image keeps the base's torch and hetfed exactly as they
# are: its dependencies must already be in the base (add further ones in a RUN line of your own). A
# .dockerignore in the package folder keeps data out.
ARG BASE=localhost/hetfed-client:0.1.0

FROM ${BASE}
# A `module:function` (or module) that must import in the finished environment: the build fails if not.
ARG CHECK=hetfed_example.models:resnet
# Set only behind a TLS-inspecting proxy: the CA bundle pip must trust (mounted, never copied).
ARG PIP_CERT
ARG HETFED_UID=10001
LABEL org.opencontainers.image.title="hetfed-client-own-code" \
      org.opencontainers.image.description="hetfed client with an organization's own model and data code"
# The base runs as the numeric non-root user; installing into /opt/hetfed needs root for this step only.
USER 0:0
COPY . /tmp/own-code
RUN /opt/hetfed/bin/pip install --no-cache-dir --no-deps /tmp/own-code \
    && rm -rf /tmp/own-code \
    && /opt/hetfed/bin/python -c "import importlib, sys; m, _, f = sys.argv[1].partition(':'); o = importlib.import_module(m); assert not f or callable(getattr(o, f)), sys.argv[1]" "${CHECK}"
USER ${HETFED_UID}:${HETFED_UID}
WORKDIR /tmp
ENTRYPOINT ["hetfed"]
CMD ["client", "--config", "/etc/hetfed/config/client.toml"]
