# deploybot: the Slack bot in a small image. Configuration is mounted at
# /etc/deploybot/deploybot.toml; secrets come from the environment.
FROM python:3.12-slim

RUN useradd --create-home --uid 10001 deploybot
WORKDIR /src
COPY pyproject.toml README.md ./
COPY bot ./bot
COPY handlers ./handlers
COPY backends ./backends
COPY store ./store
RUN pip install --no-cache-dir . && rm -rf /src

USER deploybot
WORKDIR /home/deploybot
ENV DEPLOYBOT_CONFIG=/etc/deploybot/deploybot.toml \
    PYTHONUNBUFFERED=1
CMD ["deploybot", "serve"]
