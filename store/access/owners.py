"""`Store`'s runners and what they hold (split from store/db.py): registering, renewing
and claiming (store/owners.py), the lease timer's reads and writes (store/leases.py), and
the IPAM records jobs hold (store/addresses.py, for bot/addressing.py)."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from datetime import datetime

from bot.models import AuditEvent, IpamState, Job, JobState
from bot.models.notices import Notice
from store import addresses, leases, owners
from store.access.base import Access


class OwnerAccess(Access):
    """Mixed into `Store`."""

    async def register_runner(self, runner: owners.RunnerRow) -> None:
        await self._call(owners.register, runner)

    async def renew(
        self,
        runner_id: str,
        now: datetime,
        until: datetime,
        local: Collection[str],
        pending: Collection[str] = (),
    ) -> list[owners.Owned]:
        """Renew what runs here (`local`) and what is `pending`; all this runner holds,
        each marked whether it runs here (store/owners.renew)."""
        return await self._call(owners.renew, runner_id, now, until, local, pending)

    async def claim_of(self, job_id: str) -> tuple[str | None, int] | None:
        """The job's owner and claim epoch (None: no such job): a step's fence."""
        return await self._call(owners.claim_of, job_id)

    async def hand_back(self, runner_id: str, ids: Collection[str]) -> int:
        """End the leases of held jobs and builds nothing here runs any more."""
        return await self._call(owners.hand_back, runner_id, ids)

    async def claim(
        self,
        job_id: str,
        runner_id: str,
        now: datetime,
        until: datetime,
        states: Iterable[JobState] = (JobState.QUEUED,),
    ) -> int | None:
        """The claim's epoch, or None when another holds the job (store/owners.claim)."""
        return await self._call(owners.claim, job_id, runner_id, now, until, tuple(states))

    async def claim_queued(
        self, runner_id: str, now: datetime, until: datetime, limit: int
    ) -> list[tuple[str, str]]:
        """Claim up to `limit` unheld queued jobs for this runner: (id, backend) of each."""
        return await self._write(owners.claim_queued, runner_id, now, until, limit)

    async def abandoned(self, now: datetime) -> list[Job]:
        return await self._call(owners.abandoned, now)

    async def registered_runners(self, runner_ids: Collection[str]) -> set[str]:
        """Those of these runners that may be alive (store/owners.registered)."""
        return await self._call(owners.registered, frozenset(runner_ids))

    async def release_runner(self, runner_id: str, now: datetime) -> int:
        return await self._call(owners.release, runner_id, now)

    async def live_runners_on(self, host: str, now: datetime) -> list[tuple[str, int, str]]:
        return await self._call(owners.live_on_host, host, now)

    async def declare_dead(self, runner_id: str, now: datetime) -> None:
        await self._call(owners.declare_dead, runner_id, now)

    async def request_cancel(self, job_id: str, by: str) -> bool:
        return await self._call(owners.request_cancel, job_id, by)

    # --- leases (store/leases.py) ------------------------------------------------------

    async def lease_watched(self) -> list[Job]:
        """Ready jobs with a lease, and powered-off ones: what the lease timer looks at."""
        return await self._call(leases.watched)

    async def lease_write(
        self,
        step: str,
        job: Job,
        value: str | datetime,
        notices: Sequence[Notice],
        audit: AuditEvent,
        dedupe_key: str | None = None,
    ) -> Job | None:
        """One lease step as a compare-and-set against `job` as read (store/leases.write)."""
        done = await self._call(leases.write, step, job, value, notices, audit, dedupe_key)
        self._noticed(done is not None and bool(notices))
        return done

    # --- addresses (bot/addressing.py) ---------------------------------------------

    async def held_addresses(self) -> dict[str, tuple[str, str, str, bool]]:
        """address -> (job id, VM name, backend, holding) of each job holding its
        address, or whose VM a rollback left behind (holding False)."""
        return await self._call(addresses.held)

    async def address_holder(self, address: str) -> tuple[str, str, str, bool] | None:
        """`held_addresses` for one address."""
        return await self._call(addresses.holder, address)

    async def unreleased_addresses(self) -> list[Job]:
        return await self._call(addresses.unreleased)

    async def set_ipam_state(self, job_id: str, expected: list[IpamState], new: IpamState) -> bool:
        return await self._call(addresses.set_ipam_state, job_id, expected, new)

    async def job_states(self, job_ids: list[str]) -> dict[str, JobState]:
        return await self._call(addresses.known_ids, job_ids)
