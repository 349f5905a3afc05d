"""The Slack app manifest, for `deploybot manifest` and for manifest.yml.

The manifest is data here, so `deploybot manifest --command /vm` can print it for
another command name without a YAML library at run time; tests check that manifest.yml
is exactly what this prints for `/deploy` and that both match Slack's schema.
"""

from __future__ import annotations

import json
import re
from typing import Any

# Slack's rule for a slash command name (the manifest schema's pattern and lengths).
COMMAND_RE = re.compile(r"^/[a-z0-9_-]{1,31}$")

USAGE_HINT = (
    "web01 10.0.0.50 [mem=4G] [disk=+20G] | status JOB | list | destroy NAME | "
    "lease extend NAME [7d] | template build PROFILE | history | help"
)
# Only the scopes the bot uses: answering commands, posting and updating its messages
# (also in public channels it was not invited to), reading approver user groups, and
# people's time zones (users.info: lease times in their zone).
BOT_SCOPES = ["commands", "chat:write", "chat:write.public", "usergroups:read", "users:read"]


def manifest(command: str = "/deploy") -> dict[str, Any]:
    return {
        "display_information": {
            "name": "deploybot",
            "description": f"Deploy VMs from golden templates with {command}",
            "background_color": "#2c3e50",
        },
        "features": {
            # Outcomes are also told to the requester in the app's Messages tab (a
            # chat.postMessage to their user id); they read there, they do not type.
            # The Home tab shows their VMs, quota and approvals (handlers/slack/home.py).
            "app_home": {
                "home_tab_enabled": True,
                "messages_tab_enabled": True,
                "messages_tab_read_only_enabled": True,
            },
            "bot_user": {"display_name": "deploybot", "always_online": True},
            "slash_commands": [
                {
                    "command": command,
                    "description": "Deploy a VM from a template, or check on a deploy",
                    "usage_hint": USAGE_HINT,
                    "should_escape": False,
                }
            ],
        },
        "oauth_config": {"scopes": {"bot": BOT_SCOPES}},
        "settings": {
            "event_subscriptions": {"bot_events": ["app_home_opened"]},
            "interactivity": {"is_enabled": True},
            "org_deploy_enabled": False,
            "socket_mode_enabled": True,
            "token_rotation_enabled": False,
        },
    }


HEADER = """\
# Slack app manifest for deploybot (Socket Mode: no public URL needed).
# Create the app from this file at api.slack.com/apps, then set SLACK_BOT_TOKEN and
# SLACK_APP_TOKEN in the bot's environment. `deploybot manifest --command /NAME` prints
# it for another command name. For HTTP mode, set socket_mode_enabled to false and give
# the slash command, interactivity and event subscriptions a url ending in /slack/events.
"""


def to_yaml(data: Any, indent: int = 0) -> str:
    """YAML for the manifest's plain shapes (mappings, lists, strings, booleans)."""
    pad = "  " * indent
    lines: list[str] = []
    if isinstance(data, dict):
        for key, item in data.items():
            if isinstance(item, dict | list):
                lines.append(f"{pad}{key}:")
                lines.append(to_yaml(item, indent + 1))
            else:
                lines.append(f"{pad}{key}: {_scalar(item)}")
    else:
        for item in data:
            if isinstance(item, dict):
                body = to_yaml(item, indent + 1).splitlines()
                lines.append(f"{pad}- {body[0].strip()}")
                lines.extend(body[1:])
            else:
                lines.append(f"{pad}- {_scalar(item)}")
    return "\n".join(lines)


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    text = str(value)
    plain = text.replace("-", "").replace("_", "").replace(":", "").replace(".", "")
    if plain.isalnum() and ": " not in text and not text[:1].isdigit():
        return text
    return json.dumps(text)  # a JSON string is a valid double-quoted YAML scalar


def manifest_yaml(command: str = "/deploy") -> str:
    return HEADER + to_yaml(manifest(command)) + "\n"
