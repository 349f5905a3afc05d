# deploybot: the Slack bot in a small image. Configuration is mounted at
# /etc/deploybot/deploybot.toml; secrets come from the environment.
# The exact Python the lock files were resolved with (requirements.lock: 3.11).
FROM python:3.11.11-slim-bookworm

RUN useradd --create-home --uid 10001 deploybot
WORKDIR /src
COPY pyproject.toml README.md requirements.lock ./
COPY bot ./bot
COPY handlers ./handlers
COPY backends ./backends
COPY store ./store
# Exactly the locked versions, each checked by its hash; then deploybot itself.
RUN pip install --no-cache-dir --require-hashes -r requirements.lock \
    && pip install --no-cache-dir --no-deps . && rm -rf /src

USER deploybot
WORKDIR /home/deploybot
ENV DEPLOYBOT_CONFIG=/etc/deploybot/deploybot.toml \
    PYTHONUNBUFFERED=1
CMD ["deploybot", "serve"]
