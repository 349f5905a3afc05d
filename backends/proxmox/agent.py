"""Waiting for a booted guest's address through the QEMU guest agent.

Every question to an agent that is not up yet costs a request and an error line in the
node's log (HTTP 500 "QEMU guest agent is not running"). So the agent is first asked
once the guest has had its usual boot time (learned per template, `pacing`: from the
start task's end to the agent's first answer), then geometrically more often, and with
the light `agent/ping` until it answers; only then `network-get-interfaces`, repeated
(fast polling) while cloud-init has not applied the address yet. A question the API
does not answer (595: the node out of reach) is no sign of the guest either way: when
the wait ends so, it says the node did not answer, not that the agent is missing.
"""

from __future__ import annotations

import asyncio
import ipaddress
from dataclasses import dataclass, field
from typing import Any

from backends.base import RetryableError, Unreachable
from backends.guestaddr import pick_address
from backends.proxmox.api import PveApi
from backends.proxmox.apierrors import AgentNotRunning
from backends.proxmox.pacing import Pacing, PollTiming, Schedule

BOOT = "boot"  # the pacing operation: start task ended -> agent answers


@dataclass
class AgentWatch:
    """One boot of one VM: when it began, how the agent was asked, what it did so far
    (so the last error says which way it failed)."""

    since_s: float
    node: str
    template: str
    schedule: Schedule
    answered: bool = False
    seen: str = ""
    asked: list[str] = field(default_factory=list)  # what was asked, in order (tests)
    # The asks in a row that got no answer from the API (the node out of reach, a
    # busy API), and the last one's error: then the agent was not asked at all.
    unanswered: int = 0
    failure: RetryableError | None = None

    def got_no_answer(self, exc: RetryableError) -> None:
        self.unanswered += 1
        self.failure = exc

    def got_answer(self) -> None:
        self.unanswered, self.failure = 0, None

    def error(
        self, vm_id: str, now_s: float, expected: ipaddress.IPv4Address | None
    ) -> RetryableError:
        """What the wait came to: the node not answering (Unreachable: the pipeline says
        it waits for the hypervisor), else what the agent did, as `message` says."""
        if self.failure is None:
            return RetryableError(self.message(vm_id, now_s, expected), vm_id=vm_id)
        text = (
            f"VM {vm_id}: its guest agent could not be asked in {now_s - self.since_s:.0f} s: "
            f"the last {self.unanswered} question(s) got no answer from the API "
            f"(last: {self.failure.message}); check that node {self.node} is up and "
            "reachable from the API endpoint"
        )
        if isinstance(self.failure, Unreachable):
            return Unreachable(text, vm_id=vm_id)
        return RetryableError(text, vm_id=vm_id)

    def message(self, vm_id: str, now_s: float, expected: ipaddress.IPv4Address | None) -> str:
        waited = f"{now_s - self.since_s:.0f} s"
        if not self.answered:
            return (
                f"VM {vm_id}: the guest agent has not answered in {waited} "
                "(does the template have qemu-guest-agent installed and enabled?)"
            )
        wanted = f" (expected {expected})" if expected else ""
        return (
            f"VM {vm_id}: the guest agent answers but reports no usable address{wanted} "
            f"after {waited}; it reports {self.seen or 'no addresses'} "
            "(is cloud-init applying ipconfig0?)"
        )


class AgentWaits:
    """The boots being watched, by vmid; `booted` starts one, `address` waits on it."""

    def __init__(self, api: PveApi, pacing: Pacing, polling: PollTiming, window_s: float) -> None:
        self.api = api
        self.pacing = pacing
        self.polling = polling  # for the look after a look, and when nothing is known
        self.window_s = window_s
        self.watches: dict[str, AgentWatch] = {}

    def booted(self, vm_id: str, node: str, template: str, since: float | None = None) -> None:
        """The VM's start task ended: its boot clock starts `since` (when the look that
        found the task over was sent), else now. The answer to that look may come late
        when many requests queue; the boot does not wait for it."""
        schedule = self.pacing.schedule(BOOT, template, self.polling)
        now = asyncio.get_running_loop().time()
        self.watches[vm_id] = AgentWatch(min(now, since or now), node, template, schedule)

    def forget(self, vm_id: str) -> None:
        self.watches.pop(vm_id, None)

    async def address(
        self, node: str, vm_id: str, template: str, expected: ipaddress.IPv4Address | None
    ) -> ipaddress.IPv4Address:
        """Ask for up to `window_s`, then raise a RetryableError saying whether the
        agent never answered or answered without a usable address."""
        loop = asyncio.get_running_loop()
        began = loop.time()
        watch = self.watches.get(vm_id)
        if watch is None:  # started before this process, or by someone else
            watch = AgentWatch(began, node, template, Schedule(None, self.polling))
            self.watches[vm_id] = watch
        base = f"nodes/{node}/qemu/{vm_id}/agent"
        while True:
            now = loop.time()
            if watch.answered:
                at = now + self.polling.interval_s(now - watch.since_s)
            else:
                at = watch.since_s + watch.schedule.next_at()
            if at - began >= self.window_s:
                await asyncio.sleep(max(0.0, began + self.window_s - now))
                raise watch.error(vm_id, loop.time(), expected)
            await asyncio.sleep(max(0.0, at - now))
            if not watch.answered:
                sent = loop.time() - watch.since_s
                up = await self._ping(base, vm_id, watch)
                if up is None:  # no answer at all: says nothing of the boot
                    watch.schedule.miss(sent)
                    continue
                if not up:
                    watch.schedule.saw_running(sent)
                    continue
                watch.answered = True  # learnt as when the ping was sent (see taskwatch)
                self.pacing.learn(BOOT, watch.template, watch.schedule, sent)
            found = await self._interfaces(base, vm_id, watch, expected)
            if found is not None:
                self.forget(vm_id)
                return found

    async def _ping(self, base: str, vm_id: str, watch: AgentWatch) -> bool | None:
        """Whether the agent answers `ping` (POST, as the API defines it); None when
        the API gave no answer (the node out of reach, a lock): the agent was not asked."""
        watch.asked.append("ping")
        try:
            await self.api.post(f"{base}/ping", f"guest agent of VM {vm_id}")
        except AgentNotRunning:  # an answer: the agent is not up yet
            watch.got_answer()
            return False
        except RetryableError as exc:
            watch.got_no_answer(exc)  # kept, to say so if the wait ends like this
            return None
        watch.got_answer()
        return True

    async def _interfaces(
        self, base: str, vm_id: str, watch: AgentWatch, expected: ipaddress.IPv4Address | None
    ) -> ipaddress.IPv4Address | None:
        watch.asked.append("network-get-interfaces")
        try:
            answer = await self.api.get(
                f"{base}/network-get-interfaces", f"guest agent of VM {vm_id}"
            )
        except AgentNotRunning:
            watch.got_answer()
            watch.answered = False  # restarted meanwhile: ping it again
            return None
        except RetryableError as exc:
            watch.got_no_answer(exc)
            return None
        watch.got_answer()
        pairs = interfaces(answer)
        found = pick_address(pairs, expected)
        if found is None:
            watch.seen = ", ".join(f"{name} {ip}" for name, ip in pairs)
        return found


def interfaces(answer: Any) -> list[tuple[str, str]]:
    """(interface, address) pairs from `network-get-interfaces`."""
    result = answer.get("result", []) if isinstance(answer, dict) else []
    return [
        (str(iface.get("name", "")), str(ip.get("ip-address", "")))
        for iface in result
        for ip in iface.get("ip-addresses") or []
    ]
