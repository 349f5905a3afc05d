"""Addresses: the next free one, who holds one, and the IPAM's record of each job's.

Three records can say an address is taken, and a deploy asks all of them before it
records a job (and again before its clone): deploybot's own jobs (the store), the VMs on
the hypervisors (`Backend.addresses_in_use`: configured and guest-reported; every
backend, or those the subnet's `vms_on` names and the request's own), and the IPAM
(backends/ipam). With `[ipam] probe` a TCP connection to the address is tried too.

The IPAM's record of a job's address is written before the job (its id is known) and
named on the job's row in the same insert, so whatever happens next one of three paths
gives it back: the rollback's undo, the release after a reject/expiry/cancel, or the
reconciler (`reconcile`, at start and with the wreckage sweep), which also releases
records whose job was never recorded (a crash between reserve and insert).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta
from ipaddress import IPv4Address

from backends.abilities import NamesWithAddresses
from backends.base import AddressUse, Backend, VMInfo
from backends.ipam.base import AddressTaken, Ipam, NotOurs, Pool, Reservation, ReservedFor
from bot.addresses import probe
from bot.config.settings import Settings
from bot.models import HOLDING_STATES, DeployRequest, IpamState, Job, utcnow
from bot.models.errors import BackendError
from store.db import Store

log = logging.getLogger(__name__)
_ATTEMPTS = 8  # picks of a next free address before giving up (each lost a race)
# Answers of `addresses_in_use` a check already has, by backend (see `named`).
Known = Mapping[str, list[AddressUse]]


async def named(
    backends: Mapping[str, Backend], request: DeployRequest
) -> tuple[list[VMInfo], Known]:
    """The VMs called like the request on its backend; and, where that backend answers
    its addresses from the same read (`NamesWithAddresses`: vSphere's tracker), those,
    for the address check that follows (one request for both checks, not two)."""
    backend = backends[request.backend]
    if isinstance(backend, NamesWithAddresses):
        taken, uses = await backend.named_with_addresses(request.name)
        return taken, {request.backend: uses}
    return await backend.find_by_name(request.name), {}


class Addressing:
    def __init__(
        self,
        settings: Settings,
        store: Store,
        backends: Mapping[str, Backend],
        ipam: Ipam,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        self.clock = clock  # when a record with no job counts as left by a crash
        self.settings = settings
        self.store = store
        self.backends = backends
        self.ipam = ipam
        self.config = settings.ipam

    @property
    def ipam_name(self) -> str:
        return self.ipam.name or "the IPAM"

    def pool(self, request: DeployRequest) -> Pool:
        subnet = self.settings.subnet_for(request.address.ip)
        assert subnet is not None  # bot/requests/validation.py refused addresses outside them
        return subnet.as_pool()

    def reserved_for(self, job_id: str, request: DeployRequest) -> ReservedFor:
        domain = request.search_domain
        return ReservedFor(
            job_id=job_id,
            installation=self.store.installation_id,
            name=request.name,
            dns_name=f"{request.name}.{domain}" if domain else request.name,
        )

    # --- who holds an address -----------------------------------------------------

    async def held_by_jobs(self, job_id: str) -> dict[IPv4Address, tuple[str, bool]]:
        """Addresses other jobs hold, with who holds them and whether the store's index
        guards it (False: a VM a rollback left behind still has it)."""
        held = await self.store.addresses.held()
        return {IPv4Address(a): _holder(row) for a, row in held.items() if row[0] != job_id}

    async def job_holding(self, ip: IPv4Address, job_id: str) -> tuple[str, bool] | None:
        """`held_by_jobs` for one address: one indexed lookup, where parsing every held
        address for each of fifty requests at once cost the event loop ~50 ms."""
        row = await self.store.addresses.holder(str(ip))
        return None if row is None or row[0] == job_id else _holder(row)

    async def in_use(
        self, request: DeployRequest, required: str | None = None, known: Known | None = None
    ) -> tuple[dict[IPv4Address, str], list[str]]:
        """Addresses the VMs of the backends that may hold the request's subnet use
        (`Subnet.asked`), with who uses them; and the backends that could not be asked.
        `required` names the one whose failure is raised; `known`: answers the caller
        got a moment ago with its name check (`named`), not asked again."""
        subnet = self.settings.subnet_for(request.address.ip)
        assert subnet is not None  # bot/requests/validation.py refused addresses outside them
        names = subnet.asked(list(self.backends), request.backend)
        ours, known = self.store.installation_id, known or {}
        answers = await asyncio.gather(
            *(
                _answer(known[n]) if n in known else self.backends[n].addresses_in_use(ours)
                for n in names
            ),
            return_exceptions=True,
        )
        found: dict[IPv4Address, str] = {}
        unasked = []
        for name, answer in zip(names, answers, strict=True):
            if isinstance(answer, BaseException):
                if name == required or not isinstance(answer, BackendError):
                    raise answer
                unasked.append(f"{name} ({answer.message})")
                continue
            for use in answer:
                found.setdefault(
                    use.address, f"VM {use.vm_name} (id {use.vm_id}) on {name}, {use.source}"
                )
        return found, unasked

    async def conflict(
        self,
        request: DeployRequest,
        job_id: str,
        required: str | None = None,
        *,
        jobs: bool = True,
        known: Known | None = None,
    ) -> tuple[str | None, list[str]]:
        """Who, other than `job_id`, holds the request's address (None: nobody), and the
        backends that could not be asked (`known`: see `in_use`). With `jobs=False` an
        address one of our jobs holds is left to the store's insert, which says it
        better (and frees it when that job's VM was deleted by hand)."""
        ip = request.address.ip
        holder = await self.job_holding(ip, job_id)
        if holder is not None:
            who, guarded = holder
            return (None if guarded and not jobs else f"{ip} is held by {who}"), []
        vms, unasked = await self.in_use(request, required, known)
        if ip in vms:
            return f"{ip} is used by {vms[ip]}", unasked
        recorded = await self.ipam.holder(self.pool(request), ip, job_id)
        if recorded is not None:
            return f"{ip} is recorded in {self.ipam_name} as {recorded}", unasked
        if await self.answers(ip, request.backend):
            ports = ", ".join(str(p) for p in self.config.probe_ports)
            return f"{ip} answers on the network (TCP port {ports})", unasked
        return None, unasked

    async def answers(self, ip: IPv4Address, backend: str) -> bool:
        """The optional probe (bot/addresses/probe.py), from the bot or the backend's jump host;
        never outside the configured subnets."""
        if not self.config.probe or self.settings.subnet_for(ip) is None:
            return False
        config = self.settings.backend(backend)
        jump = config.ssh_jump if config is not None else None
        c = self.config
        return await probe.answers(ip, c.probe_ports, c.probe_timeout_s, jump)

    # --- reserve, activate, release -------------------------------------------------

    async def reserve(
        self, request: DeployRequest, job_id: str, known: Known | None = None
    ) -> tuple[DeployRequest, Reservation]:
        """Reserve the request's address (or, when `picked`, the next free one) for
        `job_id`; the request comes back with the reserved address. Raises `AddressTaken`
        naming the holder, `PoolExhausted`, or the IPAM's `BackendError`. `known`: see
        `in_use`."""
        pool, reserved_for = self.pool(request), self.reserved_for(job_id, request)
        if not request.picked:
            who, _ = await self.conflict(request, job_id, jobs=False, known=known)
            if who is not None:
                raise AddressTaken(who, holder=who)
            return request, await self.ipam.reserve(pool, reserved_for, address=request.address.ip)
        jobs, (vms, _) = await asyncio.gather(
            self.held_by_jobs(job_id), self.in_use(request, None, known)
        )
        skip = frozenset(jobs) | frozenset(vms)
        for _attempt in range(_ATTEMPTS):
            reservation = await self.ipam.reserve(pool, reserved_for, skip=skip)
            if not await self.answers(reservation.address, request.backend):
                return _with_address(request, reservation.address), reservation
            await self.release_ref(reservation, reserved_for)
            skip |= {reservation.address}
        raise AddressTaken(
            f"every address tried in {pool.name} answers on the network", holder="the network"
        )

    async def release_ref(self, reservation: Reservation, reserved_for: ReservedFor) -> None:
        if reservation.ref is not None:
            await self.ipam.release(reservation.ref, reserved_for)

    async def activate(self, job: Job) -> str | None:
        """The VM answers: mark its address in use in the IPAM."""
        if job.ipam_ref is None:
            return None
        await self.ipam.activate(job.ipam_ref, self.reserved_for(job.id, job.request))
        await self.store.addresses.set_ipam_state(job.id, [IpamState.RESERVED], IpamState.ACTIVE)
        return f"{job.address} active in {self.ipam_name}"

    async def release(self, job: Job) -> None:
        """Give the job's IPAM record back (idempotent), then say so on its row."""
        if job.ipam_ref is not None:
            try:
                await self.ipam.release(job.ipam_ref, self.reserved_for(job.id, job.request))
            except NotOurs as exc:  # changed by hand: never touched, but no longer ours
                log.warning("job %s: IPAM record %s left alone: %s", job.id, job.ipam_ref, exc)
        await self.store.addresses.set_ipam_state(
            job.id, [IpamState.RESERVED, IpamState.ACTIVE], IpamState.RELEASED
        )

    async def release_quietly(self, job: Job | None) -> None:
        """After a reject, expiry or cancel: release now if the IPAM answers; if not,
        the reconciler does it later."""
        if job is None or job.ipam_ref is None or job.state in HOLDING_STATES:
            return
        try:
            await self.release(job)
        except BackendError as exc:
            log.warning("job %s: releasing its address failed (%s); retried later", job.id, exc)

    async def reconcile(self) -> list[str]:
        """Release what no job holds any more: records of jobs that ended, and records a
        crash left with no job at all (once older than `stale_after_s`, since another
        process may be between reserving and recording). Returns what it released."""
        done = []
        for job in await self.store.addresses.unreleased():
            try:
                await self.release(job)
                done.append(f"{job.address} of job {job.id} ({job.state.value})")
            except BackendError as exc:
                log.warning("job %s: releasing %s failed: %s", job.id, job.address, exc)
        records = await self.ipam.records(self.store.installation_id)
        states = await self.store.addresses.job_states(sorted({r.job_id for r in records}))
        stale = self.clock() - timedelta(seconds=self.config.stale_after_s)
        for record in records:
            state = states.get(record.job_id)
            if state in HOLDING_STATES or record.created > stale:
                continue
            if state is not None and await self._is_the_jobs(record.job_id, record.ref):
                continue  # the job's own record: released above with the job
            reserved_for = ReservedFor(record.job_id, self.store.installation_id, "", "")
            try:
                await self.ipam.release(record.ref, reserved_for)
                done.append(f"{record.address} left by job {record.job_id}")
            except BackendError as exc:
                log.warning("IPAM record %s: release failed: %s", record.ref, exc)
        if done:
            log.info("released addresses no job holds: %s", "; ".join(done))
        return done

    async def _is_the_jobs(self, job_id: str, ref: str) -> bool:
        job = await self.store.jobs.get(job_id)
        return job is not None and job.ipam_ref == ref


async def _answer(uses: list[AddressUse]) -> list[AddressUse]:
    return uses


def _with_address(request: DeployRequest, address: IPv4Address) -> DeployRequest:
    iface = ipaddress.IPv4Interface(f"{address}/{request.address.network.prefixlen}")
    return DeployRequest.model_validate({**request.model_dump(), "address": iface})


def _holder(row: tuple[str, str, str, bool]) -> tuple[str, bool]:
    """Who holds an address, from the store's row, and whether its index guards it."""
    holder, name, backend, holding = row
    if holding:
        return f"job {holder} ({name} on {backend})", True
    return f"the VM job {holder} left behind ({name} on {backend})", False
