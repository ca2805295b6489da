# syntax=docker/dockerfile:1
# One image for both processes of changefeed-maintainer:
#   maintainer (default):  python -m controller.maintainer --namespace ... --liveness http://0.0.0.0:8080/healthz
#                          --readiness http://0.0.0.0:8081/readyz
#   capture agent:         python -m controller.capture --name <pod name> --namespace ...
# The Helm chart (charts/changefeed-maintainer) sets the command of each container explicitly.
#
# Build:  docker build -t changefeed-maintainer:dev .        (make image)

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# --- builder: a virtualenv with the package and its pinned dependencies (pyproject.toml) ---------------
FROM ${PYTHON_IMAGE} AS builder
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
WORKDIR /src
# Only what the wheel needs (see .dockerignore): metadata first, then the code.
COPY pyproject.toml README.md ./
COPY controller ./controller
# A non-editable install: the runtime image needs no source tree, only /opt/venv.
RUN /opt/venv/bin/pip install --no-compile . \
 && /opt/venv/bin/python -m compileall -q /opt/venv/lib \
 && /opt/venv/bin/python -c "import controller.maintainer.__main__, controller.capture.__main__"

# --- runtime: slim Python, the venv, a numeric non-root user -----------------------------------------
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="changefeed-maintainer" \
      org.opencontainers.image.description="Kopf maintainer and capture agent for TiCDC-style changefeeds" \
      org.opencontainers.image.licenses="Apache-2.0"
# Bytecode was compiled in the builder; the root filesystem is read-only in the chart.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
COPY --from=builder /opt/venv /opt/venv
# Numeric UID/GID: Kubernetes can verify runAsNonRoot only for a numeric user. It has no passwd entry and no
# USER is set, so nothing may call getpass.getuser() (the maintainer gives Kopf its identity explicitly;
# tests/integration/test_chart_pods.py runs both processes under these conditions).
USER 65532:65532
WORKDIR /tmp
# Kopf's liveness endpoint, the Prometheus endpoint /metrics (maintainer only), readiness /readyz.
EXPOSE 8080 9090 8081
ENTRYPOINT ["python", "-m"]
CMD ["controller.maintainer", "--log-format", "json", "--liveness", "http://0.0.0.0:8080/healthz", \
     "--readiness", "http://0.0.0.0:8081/readyz"]
