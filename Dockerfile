# pdgate gateway image: slim, non-root, runs `pdgate serve`.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
# The user has no home directory: caches (tokenizers from the hub) go to /tmp, which Kubernetes
# can back with an emptyDir under a read-only root filesystem (as the Helm chart does).
ENV HOME=/tmp
WORKDIR /app
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY policies ./policies
COPY engine_model ./engine_model
COPY sim ./sim
# Same install as the README, without the dev extras.
RUN pip install . && useradd --system --uid 10001 --no-create-home pdgate

USER 10001
EXPOSE 8000
ENTRYPOINT ["pdgate"]
CMD ["serve", "--config", "/etc/pdgate/config.yaml"]
