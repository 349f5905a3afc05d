"""Job tags: how a VM says which installation's job built it (`deploybot-<installation>-<job>`).

One strict grammar, read in one place: a tag that does not parse makes nothing ours.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

JOB_TAG_PREFIX = "deploybot-"
# The tag grammar: `deploybot-<installation>-<job>`, or `deploybot-<job>` as tagged before
# installations had ids. A job id starts with `j` (a deploy) or `b` (a template build).
# Ids are lower-case letters and digits (bot/models makes them from a smaller alphabet);
# anything else with the prefix is not a job tag.
INSTALLATION_LEN = 10
_TAG = re.compile(
    rf"^{JOB_TAG_PREFIX}(?:(?P<inst>[a-z0-9]{{{INSTALLATION_LEN}}})-(?P<job>[jb][a-z0-9]{{6,24}})"
    r"|(?P<legacy>j[a-z0-9]{6}))$"
)


@dataclass(frozen=True)
class JobMark:
    """What a job tag says: which installation's job built the VM. `installation` is
    None for a tag from before installations had ids (`deploybot-<job>`)."""

    installation: str | None
    job_id: str


def job_tag(job_id: str, installation: str | None = None) -> str:
    """The tag that marks a VM as built by one job of one installation.

    Lower-case letters, digits and hyphens only, so it is valid as a Proxmox tag, a
    vSphere annotation line and a simulator label alike. Jobs recorded before
    installations had ids keep their old tag (`installation=None`).
    """
    if installation is None:
        return f"{JOB_TAG_PREFIX}{job_id.lower()}"
    return f"{JOB_TAG_PREFIX}{installation}-{job_id.lower()}"


def parse_tag(tag: str) -> JobMark | None:
    """The one strict reading of a job tag; None for anything else (a human's
    `deploybot-managed`, a typo): a VM whose tags do not parse is not ours."""
    match = _TAG.match(tag)
    if match is None:
        return None
    if match["legacy"]:
        return JobMark(None, match["legacy"])
    return JobMark(match["inst"], match["job"])


def job_marks(tags: frozenset[str] | set[str]) -> list[JobMark]:
    return sorted(
        (m for m in map(parse_tag, tags) if m is not None),
        key=lambda m: (m.installation or "", m.job_id),
    )
