"""A deploy's pre-flight, in its check_free step: the privileges its steps will need,
asked of a backend that can say (`ChecksPrivileges`) before anything is cloned. A token
lacking, say, the guest agent's file-read is refused here with every missing privilege
named, not at the SSH step with a VM to roll back.

An answer that nothing is missing is kept per (backend, template, the NICs' segments,
certificates) for `keep_s`: privileges rarely change, and a deploy's requests are a benchmark goal
(docs/backends.md), so the pre-flight costs a deploy nothing after the first of a while.
An answer that something is missing is not kept: a grant counts at the next deploy.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from backends.abilities import ChecksPrivileges
from backends.base import Backend, MissingPrivilege, PermanentError, Segment
from bot.kinds.deploy.runs import StepFailed

log = logging.getLogger(__name__)
KEEP_S = 300.0
Key = tuple[str, str, tuple[Segment, ...], bool]  # backend, template, segments, certificates


@dataclass
class Preflight:
    """The privilege check of check_free, with its short memory of passes."""

    keep_s: float = KEEP_S
    clock: Callable[[], float] = time.monotonic
    _passed: dict[Key, float] = field(default_factory=dict)
    _asking: dict[Key, asyncio.Future[list[MissingPrivilege]]] = field(default_factory=dict)

    async def check(
        self,
        name: str,
        backend: Backend,
        template: str,
        segments: tuple[Segment, ...] = (),
        *,
        certificates: bool = False,
    ) -> str | None:
        """Raise StepFailed naming what is missing for a deploy of `template` with NICs on
        `segments` (none: the backend's default network), with `certificates` (a host CA is
        configured: installing them, InstallsHostCertificates, needs privileges of its own,
        Proxmox's agent file-write and exec); a note when the check could not be made (the
        deploy goes on: its steps will meet the real refusal, if any). The pipeline says
        `certificates` per call, so one Preflight (a benchmark's) serves any configuration."""
        if not isinstance(backend, ChecksPrivileges):
            return None
        key = (name, template, segments, certificates)
        if self._passed.get(key, float("-inf")) > self.clock():
            return None
        # Deploys arriving together (fifty at once) share one question.
        asking = self._asking.get(key)
        if asking is None:
            asking = asyncio.ensure_future(self._ask(key, backend))
            self._asking[key] = asking
            asking.add_done_callback(lambda _done: self._asking.pop(key, None))
        try:
            lacking = await asyncio.shield(asking)
        except PermanentError as exc:  # a RetryableError is the step's to retry
            log.warning("%s: privileges of a deploy of %s not checked: %s", name, template, exc)
            return f"privileges not checked ({exc.message})"
        if lacking:
            raise StepFailed("check_free", refusal(name, lacking))
        return None

    async def _ask(self, key: Key, backend: ChecksPrivileges) -> list[MissingPrivilege]:
        _name, template, segments, certificates = key
        lacking = await backend.missing_privileges(template, segments, certificates=certificates)
        if not lacking:
            self._passed[key] = self.clock() + self.keep_s
        return lacking


def refusal(backend: str, lacking: list[MissingPrivilege]) -> str:
    """One message: each missing privilege with its path and what it is for."""
    purposes: dict[tuple[str, str], list[str]] = {}
    for item in lacking:
        steps = purposes.setdefault((item.privilege, item.where), [])
        if item.step not in steps:
            steps.append(item.step)
    named = "; ".join(
        f"{privilege} on {where} (to {', '.join(steps)})"
        for (privilege, where), steps in purposes.items()
    )
    return (
        f"{lacking[0].account} lacks privileges this deploy needs on {backend}: {named}. "
        "Nothing was created; grant them, then deploy again (`deploybot check` lists them)"
    )
