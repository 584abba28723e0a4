# The EnvLoop image: the Dagster code location (`dagster api grpc -m envloop_pipelines.definitions`),
# run and step pods, `envloop train` / `envloop serve`, the sandboxed verifier worker, and the MLflow
# server of k8s/mlflow.yaml (mlflow and the Postgres driver are dependencies).
#
#   docker build -t registry.example.com/envloop/envloop-pipelines:0.1.0 .
#   docker build --build-arg TORCH_VARIANT=cu128 -t registry.example.com/envloop/envloop-pipelines:0.1.0-cu128 .
#
# TORCH_VARIANT names PyTorch's wheel index (https://download.pytorch.org/whl/<variant>) and the local
# version of the one torch pin: constraints.txt pins torch==2.13.0+cpu, and a CUDA build swaps that pin
# (and nothing else) for torch==2.13.0+<variant>. Every other package comes from PyPI at its pin.
#
# No ENTRYPOINT: the Dagster chart and the run launcher pass the whole command as container args
# (`dagster api grpc ...`, `dagster api execute_run ...`), and `docker run IMAGE envloop train ...`
# works the same way. The default command is the code server.

FROM python:3.11-slim AS build
ARG TORCH_VARIANT=cpu
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DS_BUILD_OPS=0
WORKDIR /src
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# dagster.yaml: the instance file, which envloop_pipelines/dagster.yaml links to (the wheel ships its content).
COPY pyproject.toml constraints.txt README.md dagster.yaml ./
COPY envloop_pipelines ./envloop_pipelines
# DS_BUILD_OPS=0 (above): DeepSpeed compiles its CUDA ops at first use on a GPU, not at install.
RUN sed -i "s/^torch==2\.13\.0+cpu$/torch==2.13.0+${TORCH_VARIANT}/" constraints.txt \
 && grep -qx "torch==2.13.0+${TORCH_VARIANT}" constraints.txt \
 && pip install -c constraints.txt --extra-index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}" . \
 && pip check

FROM python:3.11-slim
ARG TORCH_VARIANT=cpu
LABEL org.opencontainers.image.title="envloop-pipelines" \
      org.opencontainers.image.version="0.1.0" \
      io.envloop.torch-variant="${TORCH_VARIANT}"
# Non-root: uid 10001 (the manifests' runAsUser); /opt/dagster/dagster_home is the chart's DAGSTER_HOME
# (its dagster.yaml comes from a ConfigMap), /envloop-home and /models are volume mount points.
RUN useradd --uid 10001 --user-group --create-home --home-dir /home/envloop --shell /usr/sbin/nologin envloop \
 && mkdir -p /opt/dagster/dagster_home /envloop-home /models \
 && chown envloop:envloop /opt/dagster/dagster_home /envloop-home
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    DAGSTER_HOME=/opt/dagster/dagster_home \
    ENVLOOP_HOME=/envloop-home \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1
USER 10001:10001
WORKDIR /home/envloop
EXPOSE 3030 5000 8000
CMD ["dagster", "api", "grpc", "-h", "0.0.0.0", "-p", "3030", "-m", "envloop_pipelines.definitions"]
