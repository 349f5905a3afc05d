"""The words every other text module builds on (split from handlers/messages/core.py):
the names of steps and states, and the mrkdwn escaping, mentions and times."""

from __future__ import annotations

from datetime import UTC, datetime, tzinfo
from typing import NamedTuple

from bot.models import JobState

STEP_LABELS = {
    "check_free": "check name and address",
    "clone": "copy template",
    "identity": "set identity (cloud-init)",
    "resize": "grow disk",
    "power_on": "power on",
    "address": "wait for address",
    "ssh": "check SSH",
    "certify": "certify the host key",
    "forget_key": "remove the private host key",
    "register": "mark the address in use (IPAM)",
    "rollback": "roll back",
    "stop": "stop the VM",
    "destroy": "destroy the VM",
}


STATE_LABELS = {
    JobState.AWAITING_APPROVAL: "awaiting approval",
    JobState.QUEUED: "queued",
    JobState.RUNNING: "deploying",
    JobState.ROLLING_BACK: "rolling back",
    JobState.SUCCEEDED: "ready",
    JobState.FAILED: "failed",
    JobState.CANCELLED: "cancelled",
    JobState.REJECTED: "rejected",
    JobState.EXPIRED: "expired",
    JobState.RELEASED: "released (VM gone)",
    JobState.DESTROY_REQUESTED: "destroy awaiting approval",
    JobState.DESTROYING: "being destroyed",
    JobState.DESTROYED: "destroyed",
    JobState.EXPIRED_OFF: "powered off (lease ended)",
}


def step_label(step: str) -> str:
    return STEP_LABELS.get(step, step)


def escape(text: str) -> str:
    """Plain text as mrkdwn that shows it as is (`&` first, or it would be escaped twice)."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def mention(user: str) -> str:
    return f"<@{user}>"


class Said(NamedTuple):
    """Plain text and the people the bot itself named in it: user ids it took from its
    records (requester, approver, who acted), each named before anything typed. A chat
    front end may show exactly these as mentions (handlers/slack/views.mrkdwn); any
    other id in the text was typed by someone and stays text."""

    text: str
    people: tuple[str, ...] = ()


def when(moment: datetime, zone: tzinfo = UTC) -> str:
    """A time as people read it in their zone: "Tue 8 Dec 14:00 CET"."""
    local = moment.astimezone(zone)
    return f"{local:%a} {local.day} {local:%b %H:%M} {local.tzname() or 'UTC'}"
