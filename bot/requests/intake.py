"""A deploy request, from parsed arguments to a recorded job.

Validation (bot/requests/validation.py, bot/requests/admission.py), the address
(bot/addresses/allocation.py: the one asked, or the next free one, reserved before
anything is recorded), the approval policy, and the insert whose unique indexes
decide between requests racing for a name or an address. `Deployer.request_deploy`
(bot/app/service.py) calls it inside its audit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from datetime import datetime, timedelta

from backends.base import Backend
from backends.ipam.base import AddressTaken, PoolExhausted, Reservation
from bot.addresses.allocation import Addressing, Known
from bot.addresses.subnets import request_segment
from bot.approvals.decisions import approval_reason
from bot.config.settings import Settings
from bot.jobs.progress import Progress
from bot.jobs.queue import JobQueue
from bot.jobs.waiting import protected
from bot.kinds.deploy.runs import vm_ref
from bot.models import Approval, DeployRequest, IpamState, Job, JobEvent, JobState
from bot.models.errors import (
    BackendError,
    Conflict,
    Duplicate,
    InternalSignal,
    NotAllowed,
    RequestInvalid,
)
from bot.models.ids import new_job_id
from bot.people import prefs as user_prefs
from bot.requests import quotas as quota_rules
from bot.requests.admission import check_free, check_login, check_on_backend
from bot.requests.parsed import DeployArgs
from bot.requests.validation import build_request
from store.db import AlreadyDelivered, DuplicateActive, Store
from store.quotas import Usage

log = logging.getLogger(__name__)
_PICKS = 5  # tries at recording a next free address that other processes also picked
# The VM's lease in seconds (bot/leases/enforce.Leases.grant): from `lease=`, `never`, the
# request and the requester; None: no lease. Refuses what the policy does not allow.
Grant = Callable[[int | None, bool, DeployRequest, str], Awaitable[int | None]]


class _LostRace(InternalSignal):
    """The next free address was recorded by another job first."""


def addressing_lost_race(request: DeployRequest) -> str:
    return (
        f"Other deploys kept taking the next free address of {request.subnet}: give an "
        "address, or ask again."
    )


def _ipam(installation: str, reservation: Reservation) -> dict[str, object]:
    """The job's fields that tie it to this installation and its address's IPAM record."""
    return {
        "installation": installation,
        "ipam_ref": reservation.ref,
        "ipam_state": IpamState.RESERVED if reservation.ref else None,
    }


def _joined(reason: str | None, more: str | None) -> str | None:
    """Two reasons to wait for an approver as one (either may be None)."""
    return "; ".join(r for r in (reason, more) if r) or None


def already_have(job_id: str) -> str:
    return f"I already have this request as job {job_id}; follow it with `/deploy status {job_id}`."


class Intake:
    def __init__(
        self,
        settings: Settings,
        store: Store,
        backends: Mapping[str, Backend],
        addressing: Addressing,
        queue: JobQueue,
        progress: Progress,
        runner_id: str,
        claim_until: Callable[[], datetime],
        quotas: quota_rules.Quotas,
        grant: Grant | None,
    ) -> None:
        """`runner_id` and `claim_until`: a queued job is inserted already held by this
        process's runner, which starts it here. `grant`: the VM's lease
        (bot/leases/enforce.Leases.grant); None: no lease."""
        self.settings = settings
        self.store = store
        self.backends = backends
        self.addressing = addressing
        self.queue = queue
        self.progress = progress
        self.runner_id = runner_id
        self.claim_until = claim_until
        self._picking = asyncio.Lock()
        self.quotas = quotas
        self.grant = grant

    async def request(
        self,
        args: DeployArgs,
        requester: str,
        *,
        ssh_keys: tuple[str, ...] = (),
        can_wait_for_approval: bool = True,
        origin: str | None = None,
        dedupe_key: str | None = None,
        check_free_first: bool = False,
        smoke: bool = False,
    ) -> Job:
        """`Deployer.request_deploy` says what the arguments mean. `smoke`: the smoke
        deploy of a template build (bot/kinds/build/), which the build's approval covers: no
        approval, quota or lease of its own, and the build runs it (it is not queued)."""
        await self._refuse_redelivery(dedupe_key)
        request = await self._validated(args, requester, ssh_keys)
        lease_s = None
        if self.grant is not None and not smoke:
            lease_s = await self.grant(args.lease_s, args.lease_never, request, requester)
        # Before anything is reserved.
        caps, over = ([], None) if smoke else await self._quota(request)
        # The addresses the name check's read gave, for the first address check.
        known = await check_free(self.backends, request) if check_free_first else {}
        # Picks of the next free address in this process go one at a time (each
        # sees the last one recorded); another process's pick may still win the
        # insert, and then this one picks again.
        picks = request.picked or any(nic.picked for nic in request.nics)
        picking = self._picking if picks else contextlib.nullcontext()
        for attempt in range(_PICKS):
            job_id = new_job_id()
            async with picking:
                reserved, reservation = await self._reserve(
                    request, job_id, known if attempt == 0 else None
                )
                recorded = None
                try:
                    recorded = await self._record(
                        reserved,
                        can_wait_for_approval,
                        origin,
                        dedupe_key,
                        job_id,
                        reservation,
                        (caps, over),
                        lease_s,
                        smoke,
                    )
                    return recorded
                except _LostRace:
                    if attempt == _PICKS - 1:
                        raise Conflict(addressing_lost_race(reserved)) from None
                finally:
                    if recorded is None:  # not recorded: give it back now
                        await protected(self._unreserve(reservation, job_id, reserved))
        raise AssertionError("unreachable")

    async def _reserve(
        self, request: DeployRequest, job_id: str, known: Known | None
    ) -> tuple[DeployRequest, Reservation]:
        """The request's address reserved for `job_id` (the next free one when none was
        asked), or a refusal that says who holds it."""
        try:
            return await self.addressing.reserve(request, job_id, known)
        except AddressTaken as taken:
            raise Conflict(
                f"{taken.message}: pick another address, or leave it out to get the next free one."
            ) from None
        except PoolExhausted as exc:
            raise Conflict(
                f"No free address is left in {request.subnet} ({exc.message}): ask an "
                "operator to widen its pool, or give another subnet=."
            ) from None
        except BackendError as exc:
            where = self.addressing.ipam_name
            if exc.retryable:  # NetBox's message names it and says what went wrong
                said = exc.message if exc.message.startswith(where) else f"{where}: {exc.message}"
                raise RequestInvalid([f"{said}; try again in a minute."]) from None
            raise RequestInvalid([f"{where} refused: {exc.message}"]) from None

    async def _unreserve(
        self, reservation: Reservation, job_id: str, request: DeployRequest
    ) -> None:
        try:
            await self.addressing.release_ref(
                reservation, self.addressing.reserved_for(job_id, request)
            )
        except BackendError as exc:  # the reconciler gives it back later
            log.warning("could not release %s reserved for %s: %s", request.address, job_id, exc)

    async def _refuse_redelivery(self, dedupe_key: str | None) -> None:
        """Answer a redelivery before validating again (by then its own job holds the name).

        Only an early answer: the insert's claim on the key is what enforces it.
        """
        if dedupe_key is None:
            return
        job_id = await self.store.jobs.delivered(dedupe_key)
        if job_id is not None:
            raise Duplicate(already_have(job_id), job_id)

    async def _validated(
        self, args: DeployArgs, requester: str, ssh_keys: tuple[str, ...]
    ) -> DeployRequest:
        request = await self.offline_request(args, requester, ssh_keys)
        segment = request_segment(
            self.settings.subnets,
            request.subnet,
            request.address.ip,
            request.backend,
            request.network,
        )
        if isinstance(segment, str):  # build_request refused it already
            raise RequestInvalid([segment])
        template = await check_on_backend(self.backends, request, segment)
        if args.user is None and template.default_user not in (None, request.user):
            # The image's own login user beats the site default: the SSH line must work.
            request = DeployRequest.model_validate(
                {**request.model_dump(), "user": template.default_user}
            )
        return request

    async def offline_request(
        self, args: DeployArgs, requester: str, ssh_keys: tuple[str, ...] = ()
    ) -> DeployRequest:
        """The request as the intake would take it, refused for what needs no backend
        (who may deploy, sizes, subnet, login); a template build checks its smoke
        deploy with it before its template exists."""
        policy = self.settings.approval
        if policy.deployers and requester not in policy.deployers:
            raise NotAllowed(
                f"{requester} is not on the list of people who may deploy; ask one of "
                f"{', '.join(policy.approvers) or 'the operators'} to add you.",
                people=(requester, *policy.approvers),
            )
        prefs = await user_prefs.for_deploy(self.store, requester)
        request = build_request(
            args,
            self.settings,
            requester,
            user_keys=ssh_keys or prefs.ssh_keys,
            user_template=prefs.default_template,
        )
        check_login(request)
        return request

    async def _record(
        self,
        request: DeployRequest,
        can_wait_for_approval: bool,
        origin: str | None,
        dedupe_key: str | None,
        job_id: str,
        reservation: Reservation,
        quota: tuple[list[quota_rules.Cap], str | None],
        lease_s: int | None = None,
        smoke: bool = False,
    ) -> Job:
        """`quota`: the caps the insert checks, and why the request is over quota when
        it goes to an approver for that (`_quota`)."""
        caps, over = quota
        reason = None if smoke else _joined(approval_reason(self.settings.approval, request), over)
        wanted = quota_rules.asked(request)
        job, approval = self._job_for(request, reason, can_wait_for_approval, origin, job_id)
        job = job.model_copy(
            update={**_ipam(self.store.installation_id, reservation), "lease_s": lease_s}
        )
        attempt = 0
        while True:
            try:
                job = await self.store.jobs.insert(
                    job,
                    approval,
                    dedupe_key=dedupe_key,
                    announce=True,
                    admit=quota_rules.admission(caps, wanted),
                )
                break
            except quota_rules.OverQuota as lost:  # another request took the room meanwhile
                over, caps = self._over_quota(lost, wanted)
                reason = _joined(reason, over)
                job, approval = self._job_for(
                    request, reason, can_wait_for_approval, origin, job.id, job
                )
            except AlreadyDelivered as seen:
                raise Duplicate(already_have(seen.job_id), seen.job_id) from None
            except DuplicateActive as dup:
                if dup.what == "address" and (
                    request.picked or any(nic.picked for nic in request.nics)
                ):
                    raise _LostRace from None  # another request took it meanwhile: pick again
                attempt += 1
                if attempt == 3 or not await self._release_if_gone(request):
                    raise Conflict(await self._conflict_message(request, dup.what)) from None
        await self.progress.job_updated(job)
        if job.state is JobState.QUEUED and not smoke:
            self.queue.submit(job.id, job.backend)
        return job

    async def _quota(self, request: DeployRequest) -> tuple[list[quota_rules.Cap], str | None]:
        """The requester's quotas (checked again by the insert, under the store's lock),
        and, when the request is over one and goes to an approver for it, why."""
        wanted = quota_rules.asked(request)
        caps = await self.quotas.caps(request.requester)
        early = await self.quotas.first_over(caps, wanted)
        if early is None:
            return caps, None
        over, caps = self._over_quota(early, wanted)
        return caps, over

    def _over_quota(
        self, exc: quota_rules.OverQuota, wanted: Usage
    ) -> tuple[str, list[quota_rules.Cap]]:
        """Refuse a request over quota, or (`over = "approval"`) say why it must wait for
        an approver: the approver decides, so no cap is checked at its insert then."""
        if self.settings.quotas.over == "refuse":
            raise quota_rules.refusal(exc, wanted)
        return quota_rules.over_text(exc.cap, exc.used, wanted), []

    def _job_for(
        self,
        request: DeployRequest,
        reason: str | None,
        can_wait_for_approval: bool,
        origin: str | None,
        job_id: str,
        base: Job | None = None,
    ) -> tuple[Job, Approval | None]:
        """The job to insert (queued, or awaiting approval when there is a `reason`), and
        its approval; `base` is a job built before whose other fields stay."""
        policy = self.settings.approval
        if reason and not can_wait_for_approval:
            raise NotAllowed(
                f"This request needs approval ({reason}). Ask in Slack or in `deploybot shell`, "
                "where an approver can approve it."
            )
        state = JobState.AWAITING_APPROVAL if reason else JobState.QUEUED
        update: dict[str, object] = {"id": job_id, "approval_reason": reason, "origin": origin}
        if state is JobState.QUEUED:  # reserved for this runner: it starts it here
            update.update(owner=self.runner_id, lease_until=self.claim_until())
        else:
            update.update(owner=None, lease_until=None)
        job = (base or Job.for_request(request, state)).model_copy(
            update={**update, "state": state}
        )
        approval = None
        if reason:
            expires = job.created_at + timedelta(seconds=policy.expire_after_s)
            approval = Approval(job_id=job.id, reason_required=reason, expires_at=expires)
        return job, approval

    async def _release_if_gone(self, request: DeployRequest) -> bool:
        """A succeeded job holds the name or address: if its VM has gone since (deleted
        by hand), release the job so the name and address can be used again."""
        held = await self._holder(request)
        if held is None:
            return True  # released meanwhile: try again
        backend = self.backends.get(held.backend)
        if held.state is not JobState.SUCCEEDED or held.vm_id is None or backend is None:
            return False
        try:
            gone = await backend.find_vm(vm_ref(held)) is None
        except BackendError:
            return False
        if gone:
            detail = f"VM {held.vm_id} no longer exists; its name and address are free again"
            event = JobEvent(job_id=held.id, step="release", phase="note", detail=detail)
            # The event in the move's transaction: both land, or neither.
            await self.store.jobs.transition(
                held.id, [JobState.SUCCEEDED], JobState.RELEASED, events=[event]
            )
        return gone

    async def _holder(self, request: DeployRequest) -> Job | None:
        """The live job that holds the request's name, one of its addresses or MACs."""
        return await self.store.jobs.holder(
            backend=request.backend,
            name=request.name,
            address=str(request.address.ip),
            more=[str(nic.address.ip) for nic in request.nics],
            macs=list(request.macs),
        )

    async def _conflict_message(self, request: DeployRequest, what: str) -> str:
        held = await self._holder(request)
        thing = _held_thing(request, held, what)
        if held is not None and held.state is JobState.SUCCEEDED:
            if what == "name":
                return (
                    f"{request.name} already exists on {request.backend} (job {held.id}, VM "
                    f"{held.vm_id}): pick another name, or remove that VM first."
                )
            return (
                f"{thing} belongs to {held.name} (job {held.id}), which still exists: "
                f"pick another {'MAC' if what == 'mac' else 'address'}."
            )
        by = f" by job {held.id} ({held.name}, {held.state.value})" if held else ""
        if what == "name":
            return f"{request.name} is already being deployed{by}: pick another name or wait."
        other = "MAC" if what == "mac" else "address"
        return f"{thing} is already taken{by}: pick another {other} or wait."


def _held_thing(request: DeployRequest, held: Job | None, what: str) -> str:
    """Which of the request's addresses (or MACs) the holder has, for the message."""
    if what == "mac":
        theirs = set(held.request.macs) if held is not None else set()
        mine = [m for m in request.macs if m in theirs] or list(request.macs)
        return f"the MAC {mine[0]}" if mine else "a MAC"
    theirs_ips = {a.ip for a in held.request.addresses} if held is not None else set()
    ips = [a.ip for a in request.addresses]
    return str(next((ip for ip in ips if ip in theirs_ips), ips[0]))
