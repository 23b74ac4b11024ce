# kvserve for docker-compose.yml: the repository installed the way `make serve` does.
# Build context: the repository root (compose sets it), e.g.
#   docker build -f grafana/kvserve.Dockerfile -t kvserve .
FROM python:3.11-slim

RUN apt-get update \
 && apt-get install -y --no-install-recommends make \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /app
# The CPU build of torch first (the Makefile pins torch==2.13.0; the default PyPI wheel is the
# multi-GB CUDA build). `make install` then finds it satisfied.
RUN python -m venv .venv \
 && .venv/bin/pip install --quiet --upgrade pip \
 && .venv/bin/pip install --quiet --index-url https://download.pytorch.org/whl/cpu torch==2.13.0

COPY . .
RUN make install

EXPOSE 50051 9400
# `make serve` = `kvserve serve $(ARGS)` after the (already done) install.
ENTRYPOINT ["make", "serve"]
CMD ["ARGS=--host 0.0.0.0 --port 50051 --metrics-host 0.0.0.0 --metrics-port 9400"]
