# One image for every Stepward process: web (default), worker, beat, ticket desk.
#   docker build -t stepward .
#   docker run -e DATABASE_URL=... -e CELERY_BROKER_URL=... -e SECRET_KEY=... stepward
#   (SECRET_KEY, or SECRET_KEY_FILE=/run/secrets/...; HTTPS_ONLY=1 behind a TLS proxy)
#   docker run ... stepward celery -A console worker --loglevel INFO
#   docker run ... stepward celery -A console beat --loglevel INFO
# Resource limits (README, "Resource limits"), each with a working default; pass with -e:
#   API_MAX_WAITS_PER_AGENT=2            long-polls (?wait=) one agent may hold at once
#   API_BAD_TOKEN_RATE=30/min            requests without a valid token, per client address
#   API_CLIENT_ADDRESS_HEADER=           behind a proxy you run: the header it writes the
#                                        client's address to (e.g. X-Forwarded-For)
#   EXECUTOR_HTTP_ALLOWED_HOSTS=         host or host:port http.get may read (empty: none)
#   EXECUTOR_HTTP_MAX_RESPONSE_BYTES=1048576
#   CACHE_URL=redis://...                makes the limits hold across the web processes below
FROM python:3.13-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    STEPWARD_VAR_DIR=/var/lib/stepward

WORKDIR /app
COPY pyproject.toml README.md ./
COPY console ./console
COPY executor ./executor
COPY stepward_client ./stepward_client
COPY templates ./templates
COPY static ./static
COPY manage.py ./
# collectstatic loads the settings, which refuse to load without a key when DEBUG is off: a
# throwaway one for this step only (it signs nothing and is not in the image's environment).
RUN pip install --no-cache-dir . \
    && useradd --system --home-dir /var/lib/stepward --create-home stepward \
    && SECRET_KEY=collectstatic-at-build-time-only python manage.py collectstatic --no-input

USER stepward
EXPOSE 8000
# An event loop a process (console/asgi.py): long-polls and slow bodies hold no thread.
CMD ["gunicorn", "console.asgi", "--bind", "0.0.0.0:8000", "--workers", "3", \
     "--worker-class", "uvicorn_worker.UvicornWorker", "--access-logfile", "-"]
