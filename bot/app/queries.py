"""The read-only questions front ends ask (through `Deployer`, bot/app/service.py): the VMs
deploybot holds a page at a time, a job's status and history, what waits for an
approver, quotas, the jobs in flight, and the templates each backend offers or deploybot
built there. None of them changes the store."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from backends.base import Backend, Template
from backends.building import BuildsTemplates, TemplateVersion
from bot.jobs import refs as jobrefs
from bot.models import ACTIVE_STATES, Approval, Job, JobEvent, JobState
from bot.models.builds import Build
from bot.models.errors import BackendError
from bot.requests.quotas import Quotas, Standing
from store.db import Store

log = logging.getLogger("bot.app.service")


@dataclass(frozen=True)
class VMPage:
    """A page of `/deploy list`: `requester` None lists everyone's."""

    jobs: list[Job]
    page: int
    pages: int
    total: int
    requester: str | None


@dataclass(frozen=True)
class JobStatus:
    job: Job
    events: list[JobEvent]
    approval: Approval | None


class Queries:
    def __init__(self, store: Store, backends: Mapping[str, Backend], quotas: Quotas) -> None:
        self.store, self.backends, self.quotas = store, backends, quotas

    async def list_vms(self, requester: str | None, page: int, per_page: int) -> VMPage:
        """One page of the VMs deploybot holds (one requester's, or everyone's)."""
        total = await self.store.jobs.count_live(requester)
        pages = max(1, -(-total // per_page))
        page = min(max(1, page), pages)
        jobs = await self.store.jobs.live(requester, per_page, (page - 1) * per_page)
        return VMPage(jobs, page, pages, total, requester)

    async def pending_approvals(self) -> list[Job]:
        """Deploys and destroys waiting for an approver (the App Home)."""
        return await self.store.jobs.in_states(
            [JobState.AWAITING_APPROVAL, JobState.DESTROY_REQUESTED]
        )

    async def quota_standing(self, user: str) -> list[Standing]:
        """Each quota of `user` with what is used now (bot/requests/quotas.py)."""
        return await self.quotas.standing(user)

    async def status(self, job_id: str) -> JobStatus:
        job_id = await self._resolve(job_id)
        # The approval first: one that does not validate sets its job aside, which
        # reading the job then says.
        approval = await self.store.approvals.get(job_id)
        events = await self.store.jobs.events(job_id)
        return JobStatus(await self._job(job_id), events, approval)

    async def history(self, limit: int = 10, requester: str | None = None) -> list[Job]:
        return await self.store.jobs.history(requester=requester, limit=limit)

    async def templates(self) -> dict[str, list[Template] | str]:
        """Templates per backend; a backend that fails gets its error text, which says
        "try again" only when waiting may help (a wrong password will not go away)."""
        found: dict[str, list[Template] | str] = {}
        for name, backend in self.backends.items():
            try:
                found[name] = await backend.templates()
            except BackendError as exc:
                found[name] = f"{exc.message}; try again shortly" if exc.retryable else exc.message
        return found

    async def template_builds(self) -> dict[str, dict[str, TemplateVersion]]:
        """For each backend that builds templates, the current version of each template
        deploybot built there, by name (a backend that cannot answer is left out)."""
        found: dict[str, dict[str, TemplateVersion]] = {}
        for name, backend in self.backends.items():
            if not isinstance(backend, BuildsTemplates):
                continue
            try:
                versions = await backend.template_versions()
            except BackendError as exc:
                log.warning("%s: could not list built templates: %s", name, exc.message)
                continue
            found[name] = {v.name: v for v in versions}
        return found

    async def job(self, job_id: str) -> Job | None:
        """The job of this exact id as stored now; None when there is none (or it was
        set aside)."""
        return await self.store.jobs.get(job_id)

    async def build(self, build_id: str) -> Build | None:
        """The template build of this exact id as stored now; None when there is none."""
        return await self.store.builds.get(build_id)

    async def approval(self, job_id: str) -> Approval | None:
        return await self.store.approvals.get(job_id)

    async def in_flight(self) -> list[Job]:
        """The jobs still in flight (their names and addresses are taken)."""
        return await self.store.jobs.in_states(ACTIVE_STATES)

    async def _resolve(self, text: str) -> str:
        """The id of the job a person named by its id or a prefix of it."""
        return await jobrefs.resolve(self.store, text)

    async def _job(self, job_id: str) -> Job:
        return await jobrefs.load(self.store, job_id)
