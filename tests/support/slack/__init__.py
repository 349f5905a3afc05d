"""The fake Slack Web API and a running Slack bot on it."""
