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

    def pool(self, request: DeployRequest, ip: IPv4Address | None = None) -> Pool:
        """The pool of the request's address (or of `ip`, one of its NICs')."""
        subnet = self.settings.subnet_for(ip or request.address.ip)
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
        names: list[str] = []  # those any NIC's subnet asks, in the backends' order
        for iface in request.addresses:
            subnet = self.settings.subnet_for(iface.ip)
            assert subnet is not None  # bot/requests/validation.py refused the others
            names += [
                n for n in subnet.asked(list(self.backends), request.backend) if n not in names
            ]
        names = [n for n in self.backends if n in names]
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
        only: list[IPv4Address] | None = None,
    ) -> tuple[str | None, list[str]]:
        """Who, other than `job_id`, holds one of the request's addresses (every NIC's,
        or those in `only`; None: nobody), and the backends that could not be asked
        (`known`: see `in_use`). With `jobs=False` an address one of our jobs holds is
        left to the store's insert, which says it better (and frees it when that job's
        VM was deleted by hand)."""
        asked = [iface.ip for iface in request.addresses] if only is None else only
        ips = []  # those left to ask the VMs, the IPAM and the network about
        for ip in asked:
            holder = await self.job_holding(ip, job_id)
            if holder is None:
                ips.append(ip)
                continue
            who, guarded = holder
            if not guarded or jobs:
                return f"{ip} is held by {who}", []
        if not ips:
            return None, []
        vms, unasked = await self.in_use(request, required, known)
        for ip in ips:
            if ip in vms:
                return f"{ip} is used by {vms[ip]}", unasked
        for ip in ips:
            recorded = await self.ipam.holder(self.pool(request, ip), ip, job_id)
            if recorded is not None:
                return f"{ip} is recorded in {self.ipam_name} as {recorded}", unasked
        for ip in ips:
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
        """Reserve every address of the request (each NIC's asked one, or, when `picked`,
        the next free one of its subnet) for `job_id`, all or none: one taken gives back
        those reserved before it. The request comes back with the reserved addresses; the
        reservation is the first NIC's address with every record's ref (`joined_refs`).
        Raises `AddressTaken` naming the holder, `PoolExhausted`, or the IPAM's
        `BackendError`. `known`: see `in_use`."""
        reserved_for = self.reserved_for(job_id, request)
        picks = [request.picked, *(nic.picked for nic in request.nics)]
        asked = [a.ip for a, picked in zip(request.addresses, picks, strict=True) if not picked]
        if asked:
            who, _ = await self.conflict(request, job_id, jobs=False, known=known, only=asked)
            if who is not None:
                raise AddressTaken(who, holder=who)
        skip: frozenset[IPv4Address] = frozenset()
        if any(picks):
            jobs, (vms, _) = await asyncio.gather(
                self.held_by_jobs(job_id), self.in_use(request, None, known)
            )
            skip = frozenset(jobs) | frozenset(vms)
        made: list[Reservation] = []
        try:
            for iface, picked in zip(request.addresses, picks, strict=True):
                pool = self.pool(request, iface.ip)
                if picked:
                    made.append(await self._next_free(pool, reserved_for, skip, request.backend))
                else:
                    made.append(await self.ipam.reserve(pool, reserved_for, address=iface.ip))
        except BaseException:
            for done in made:  # all or none: nothing of a refused request is kept
                await self.release_ref(done, reserved_for)
            raise
        refs = joined_refs([m.ref for m in made])
        return _with_addresses(request, [m.address for m in made]), Reservation(
            made[0].address, refs
        )

    async def _next_free(
        self, pool: Pool, reserved_for: ReservedFor, skip: frozenset[IPv4Address], backend: str
    ) -> Reservation:
        for _attempt in range(_ATTEMPTS):
            reservation = await self.ipam.reserve(pool, reserved_for, skip=skip)
            if not await self.answers(reservation.address, backend):
                return reservation
            await self.release_ref(reservation, reserved_for)
            skip |= {reservation.address}
        raise AddressTaken(
            f"every address tried in {pool.name} answers on the network", holder="the network"
        )

    async def release_ref(self, reservation: Reservation, reserved_for: ReservedFor) -> None:
        for ref in split_refs(reservation.ref):
            await self.ipam.release(ref, reserved_for)

    async def activate(self, job: Job) -> str | None:
        """The VM answers: mark its address in use in the IPAM."""
        if job.ipam_ref is None:
            return None
        for ref in split_refs(job.ipam_ref):
            await self.ipam.activate(ref, self.reserved_for(job.id, job.request))
        await self.store.addresses.set_ipam_state(job.id, [IpamState.RESERVED], IpamState.ACTIVE)
        shown = ", ".join(str(a.ip) for a in job.request.addresses)
        return f"{shown} active in {self.ipam_name}"

    async def release(self, job: Job) -> None:
        """Give the job's IPAM record back (idempotent), then say so on its row."""
        for ref in split_refs(job.ipam_ref):  # every NIC's
            try:
                await self.ipam.release(ref, self.reserved_for(job.id, job.request))
            except NotOurs as exc:  # changed by hand: never touched, but no longer ours
                log.warning("job %s: IPAM record %s left alone: %s", job.id, ref, exc)
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
        return job is not None and ref in split_refs(job.ipam_ref)


async def _answer(uses: list[AddressUse]) -> list[AddressUse]:
    return uses


def joined_refs(refs: list[str | None]) -> str | None:
    """The IPAM records of a job's NICs as `Job.ipam_ref` keeps them: space-separated,
    the first NIC's first (None: the IPAM keeps none, as the built-in one)."""
    kept = [r for r in refs if r is not None]
    return " ".join(kept) if kept else None


def split_refs(ipam_ref: str | None) -> list[str]:
    """`joined_refs` undone; a job from before several NICs holds one ref."""
    return ipam_ref.split() if ipam_ref else []


def _with_addresses(request: DeployRequest, addresses: list[IPv4Address]) -> DeployRequest:
    """The request with its NICs' addresses as reserved (a picked one was a stand-in)."""
    if [a.ip for a in request.addresses] == addresses:
        return request
    data = request.model_dump()
    first, *more = addresses
    data["address"] = ipaddress.IPv4Interface(f"{first}/{request.address.network.prefixlen}")
    for nic, address in zip(data["nics"], more, strict=True):
        nic["address"] = ipaddress.IPv4Interface(f"{address}/{nic['address'].network.prefixlen}")
    return DeployRequest.model_validate(data)


def _holder(row: tuple[str, str, str, bool]) -> tuple[str, bool]:
    """Who holds an address, from the store's row, and whether its index guards it."""
    holder, name, backend, holding = row
    if holding:
        return f"job {holder} ({name} on {backend})", True
    return f"the VM job {holder} left behind ({name} on {backend})", False
