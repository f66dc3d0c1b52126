# GPU worker image: the `[gpu]` extra (the official vLLM + DeepSpeed) for the `full-gpu` deployment, as a process
# worker on a GPU host or as the Kubernetes job image (infra/k8s/gpu-base-job-template.json).
# It is built by the same recipe as the CPU vLLM environment the vLLM tests run in (`make vllm-venv`): vLLM
# first, then the project at its own pins. vLLM 0.32.0 shares those pins (torch 2.13.0, transformers 5.19),
# so this image runs the torch and transformers versions the test suite runs; only fastapi differs from
# vLLM's wish (Makefile, "vllm-venv"). torch here is PyPI's CUDA build of 2.13.0.
# Build from the repo root: docker build -f infra/gpu-worker.Dockerfile -t rcgrpo-gpu-worker .
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
RUN apt-get update && apt-get install -y --no-install-recommends python3.11 python3.11-venv git make \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/rcgrpo
COPY . /opt/rcgrpo
# VLLM_DROP empty: the CUDA torchvision / torchaudio builds load beside the CUDA torch
RUN make vllm-venv PY=python3.11 VLLM_VENV=/opt/venv VLLM_EXTRA=gpu VLLM_DROP= && (git init -q || true)
ENV PATH=/opt/venv/bin:$PATH
CMD ["prefect", "worker", "start", "--pool", "rcgrpo-gpu", "--type", "process"]
