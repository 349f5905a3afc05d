"""The store's repositories: what the core may ask of each table, as `Store` holds them.

Each query is one plain function of a `Db` in its table's module (written once, for both
databases); a repository names it, with how it runs on the engine (store/repository.py):
`call` alone, `write` batched with the writes of the moment. The docstrings are the
functions' own.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from bot.models import Job, JobState
from store import (
    addresses,
    applies,
    approvals,
    builds,
    deliveries,
    destroys,
    durations,
    gc,
    inbox,
    jobs,
    leases,
    outbox,
    owners,
    plans,
    quarantine,
    quotas,
    users,
)
from store.repository import Repository, call, gathered, merged, write


class Jobs(Repository):
    """`jobs` and their `events`: insert with its dedupe key and quota check, read,
    compare-and-set, history and the counts front ends show."""

    insert = write(jobs.insert_job)
    delivered = call(deliveries.delivered)
    holder = call(jobs.holder)
    get = call(jobs.get_job)
    match_ids = call(jobs.match_ids)
    kind_of = call(jobs.kind_of)
    quarantined = call(quarantine.find)
    quarantine_records = call(quarantine.records)
    transition = write(jobs.transition)
    move = write(jobs.move)
    update = write(jobs.update_job)
    transition_once = write(destroys.transition_once)
    request_cancel = call(owners.request_cancel)
    add_event = merged(jobs.add_event, jobs.add_events)
    events = call(jobs.events)
    step_durations = call(durations.step_durations)
    history = call(jobs.history)
    history_page = call(jobs.history_page)
    count_by_state = call(jobs.count_by_state)
    with_wreckage = call(jobs.jobs_with_wreckage)
    in_states = call(jobs.jobs_in)
    host_keys = call(jobs.host_keys)
    live = call(destroys.live)
    count_live = call(destroys.count_live)
    quota_usage = call(quotas.usage)

    async def history_pages(
        self,
        *,
        requester: str | None = None,
        state: JobState | None = None,
        name: str | None = None,
        limit: int = 10,
        page_size: int = 500,
    ) -> AsyncIterator[list[Job]]:
        """`history`'s first `limit` jobs, newest first, a page of at most `page_size` at
        a time (one query each): a long listing holds one page in memory, not all."""
        after: jobs.HistoryCursor | None = None
        left = limit
        while left > 0:
            page, after = await self.history_page(
                requester=requester, state=state, name=name, after=after, limit=min(page_size, left)
            )
            left -= len(page)
            if page:
                yield page
            if after is None:
                return


class Runners(Repository):
    """`runners` and the jobs and builds they hold: registering, renewing, claiming,
    handing back, and declaring a runner dead."""

    register = call(owners.register)
    renew_claims = call(owners.renew_claims)
    claim_of = gathered(owners.claim_of, owners.claims_of)  # a step's fence: two columns
    hand_back = call(owners.hand_back)
    claim = call(owners.claim)
    claim_queued = write(owners.claim_queued)
    abandoned = call(owners.abandoned)
    registered = call(owners.registered)
    release = call(owners.release)
    live_on_host = call(owners.live_on_host)
    declare_dead = call(owners.declare_dead)


class Leases(Repository):
    """VM leases (bot/leases/enforce.py): what the lease timer watches, and its steps."""

    watched = call(leases.watched)
    write_step = call(leases.write)


class Addresses(Repository):
    """The IPAM records jobs hold (bot/addresses/allocation.py)."""

    held = call(addresses.held)
    holder = gathered(addresses.holder, addresses.holders)
    unreleased = call(addresses.unreleased)
    set_ipam_state = call(addresses.set_ipam_state)
    job_states = call(addresses.known_ids)


class Approvals(Repository):
    """`approvals`: read one, decide it with its notices, expire, cancel."""

    get = call(approvals.get_approval)
    decide = write(approvals.decide)
    expired = call(approvals.expired_approvals)
    cancel_awaiting = write(approvals.cancel_awaiting)


class Outbox(Repository):
    """The notices a chat front end delivers, and who delivers each job's."""

    new_since = call(outbox.new_since)
    undelivered = call(outbox.undelivered)
    claim = write(outbox.claim)
    renew_delivery_claims = call(outbox.renew_delivery_claims)
    orphaned = call(outbox.orphaned)
    mark_delivered = write(outbox.mark_delivered)
    release = write(outbox.release)
    pending = call(outbox.pending_count)


class Inbox(Repository):
    """Chat commands being handled, kept until done."""

    add = call(inbox.add)
    refuse = call(inbox.refuse)
    done = write(inbox.done)
    claim_orphaned = write(inbox.claim_orphaned)


class People(Repository):
    """People's saved settings and SSH keys."""

    get_prefs = call(users.get_prefs)
    put_prefs = call(users.put_prefs)
    add_ssh_key = call(users.add_key)


class Audit(Repository):
    """The audit log."""

    add = write(users.add_audit)
    events = call(users.audit_events)


class GcRuns(Repository):
    """The gc runs whose dry run an apply must follow (bot/operations/gc.py)."""

    record = call(gc.record_gc_run)
    last_dry_run = call(gc.last_gc_dry_run)


class Builds(Repository):
    """Template builds (bot/kinds/build/)."""

    insert = call(builds.insert_build)
    get = call(builds.get_build)
    match = call(builds.match_builds)
    move = call(builds.move_build)
    update = write(builds.update_build)
    request_cancel = call(builds.request_cancel)
    recent = call(builds.list_builds)
    abandoned = call(builds.abandoned_builds)
    awaiting = call(builds.awaiting_builds)
    of_profiles = call(builds.profile_builds)


class MigrationPlans(Repository):
    """Migration plans made from chat, applied by id (bot/migration/)."""

    keep = call(plans.keep_plan)
    get = call(plans.get_plan)


class MigrationApplies(Repository):
    """Migration applies asked from chat, until their last build ends (store/applies.py)."""

    record = call(applies.record_apply)
    get = call(applies.get_apply)
