# specserve image for docker-compose.yml: one image, three roles (specserve target | draft | gateway).
FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /opt/specserve
# torch first (the CUDA build from PyPI), so code changes do not reinstall it
RUN pip install torch==2.13.0
COPY pyproject.toml README.md ./
COPY specserve specserve
COPY gateway gateway
COPY draft_service draft_service
COPY target_service target_service
COPY kernels kernels
COPY protos protos
RUN pip install '.[gpu]'
ENTRYPOINT ["specserve"]
