"""`deploybot gc`: find VMs that carry a deploybot job tag but have no business existing.

A VM is classified by its job tags, read with the one strict grammar
(`backends.base.parse_tag`: `deploybot-<installation>-<job>`, or `deploybot-<job>` from
before installations had ids). A tag that does not parse (a human's `deploybot-managed`)
makes nothing ours. Orphans, which `--apply` may remove:

* `unknown_job`: a tag of this installation whose job this store has never heard of
  (a VM copied from elsewhere, a job row lost with a restored backup);
* `ended_job`: the job failed, was cancelled, rejected or expired, so its rollback
  should have removed the VM (wreckage).

Listed, never removed: the job succeeded (someone's machine) or is in flight;
`other_installation`: another deploybot database's VM on the same cluster (staging
next to production); `unknown_legacy`: an old-style tag whose job this store does not
know, which may be another installation's too. VMs without a tag are never listed.

A VM whose hypervisor still keeps the private host key deploybot chose for it (a
`ChoosesHostKeys` backend's stored cloud-config, which the deploy blanks once the VM is
ready or rolled back) is listed too, whatever its category but in flight (its deploy
blanks it); `--apply` blanks it (`forget_host_key`) for the VMs it leaves.

An orphan that another operation holds (the hypervisor's lock on it: a backup, a
snapshot, a migration) is not removed: `--apply` lists it as locked, with the lock, so
the person can wait for that operation or clear a stale lock, then run gc again.

Removal is a two-step rule taken from migrations that must not destroy the wrong
thing: a dry run first, counted per category, and an `--apply` of the same scope within
`window_s` that removes only VMs the dry run listed and that are still orphans now.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

from backends.abilities import ChoosesHostKeys
from backends.base import Backend, VMInfo, VMRef
from backends.tags import JobMark, job_marks
from bot.config.sections import Timeouts
from bot.jobs.waiting import remove_vm
from bot.models import ACTIVE_STATES, DESTROY_STATES, JobState, utcnow
from bot.models.builds import ACTIVE_BUILD_STATES, Build, BuildState
from bot.models.errors import BackendError, UserError
from store.db import Store

ORPHAN = ("unknown_job", "ended_job")
# VMs whose stored cloud-config gc checks for a private host key (and `--apply` blanks):
# those carrying this installation's tag for a job that is not in flight.
KEYS_CHECKED = ("unknown_job", "ended_job", "succeeded_job", "quarantined_job")
# A quarantined job's record is damaged: whether its VM is wanted is for a person to say.
KEPT = (
    "succeeded_job",
    "published_build",
    "job_in_flight",
    "other_installation",
    "unknown_legacy",
    "quarantined_job",
)
KEPT_WHY = {
    "succeeded_job": "its job succeeded",
    "published_build": "a template a build published (`deploybot template gc` retires old ones)",
    "job_in_flight": "its job is in flight",
    "other_installation": "another installation's VM (never removed here)",
    "unknown_legacy": "an old-style tag this database does not know: remove it by hand if "
    "nobody claims it",
    "quarantined_job": "its job's record is damaged (quarantined): check it by hand",
}


@dataclass(frozen=True)
class Finding:
    backend: str
    vm: VMInfo
    job_id: str
    category: str
    installation: str | None = None  # from the tag (None: an old-style tag)

    @property
    def ref(self) -> VMRef:
        return VMRef(self.vm.vm_id, self.job_id, self.vm.placement, self.installation)

    @property
    def key(self) -> str:
        return f"{self.backend}:{self.vm.vm_id}:{self.job_id}"

    @property
    def orphan(self) -> bool:
        return self.category in ORPHAN


@dataclass
class GcReport:
    scope: tuple[str, ...]
    applied: bool
    findings: list[Finding] = field(default_factory=list)
    unreachable: dict[str, str] = field(default_factory=dict)
    removed: list[Finding] = field(default_factory=list)
    left: list[tuple[Finding, str]] = field(default_factory=list)
    # Orphans another operation holds (`vm.lock`: a backup, a snapshot): left alone.
    locked: list[Finding] = field(default_factory=list)
    # Backends that refused to be asked (credentials, TLS): another run alone won't help.
    refused: dict[str, str] = field(default_factory=dict)
    # VMs whose hypervisor still keeps the private host key deploybot chose (in flight
    # excepted); with --apply, those blanked (`keys_forgotten`) and those that failed.
    holding_keys: list[Finding] = field(default_factory=list)
    keys_forgotten: list[Finding] = field(default_factory=list)

    @property
    def orphans(self) -> list[Finding]:
        return [f for f in self.findings if f.orphan]

    def counts(self) -> dict[str, Counter[str]]:
        """Per backend, how many VMs fell in each category."""
        per: dict[str, Counter[str]] = {b: Counter() for b in self.scope}
        for finding in self.findings:
            per[finding.backend][finding.category] += 1
        return per


async def classify(store: Store, backend_name: str, vm: VMInfo) -> list[Finding]:
    findings = []
    for mark in job_marks(vm.tags):
        category = await _category(store, mark)
        findings.append(Finding(backend_name, vm, mark.job_id, category, mark.installation))
    return findings


async def _category(store: Store, mark: JobMark) -> str:
    if mark.installation is not None and mark.installation != store.installation_id:
        return "other_installation"
    job = await store.jobs.get(mark.job_id)
    if job is None and (build := await store.builds.get(mark.job_id)) is not None:
        return _build_category(build)  # the tag names a template build's row
    if job is None and await store.jobs.quarantined(mark.job_id) is not None:
        return "quarantined_job"
    if job is None and mark.installation is not None:
        return "unknown_job"  # tagged by this installation: ours to clean
    if job is None or job.installation != mark.installation:
        # An old-style tag naming no job of ours, or a tag unlike the one our job wrote:
        # it may be anybody's, so it is listed and left alone.
        return "unknown_legacy"
    if job.state is JobState.SUCCEEDED:
        return "succeeded_job"
    if job.state in ACTIVE_STATES or job.state in DESTROY_STATES:
        return "job_in_flight"  # a destroy waiting or under way: its own path removes it
    return "ended_job"


def _build_category(build: Build) -> str:
    """A VM a template build made (its half-built VM, or the template where a backend
    lists templates): the build's own rollback removes what it made, so only a build
    that ended leaves an orphan (one this store never heard of is an unknown job's)."""
    if build.state is BuildState.PUBLISHED:
        return "published_build"
    if build.state in ACTIVE_BUILD_STATES:
        return "job_in_flight"
    return "ended_job"


async def survey(store: Store, backends: Mapping[str, Backend], scope: Sequence[str]) -> GcReport:
    """List and classify every tagged VM in scope. Changes nothing."""
    report = GcReport(tuple(sorted(scope)), applied=False)
    for name in report.scope:
        try:
            vms = await backends[name].find_tagged()
        except BackendError as exc:
            (report.unreachable if exc.retryable else report.refused)[name] = exc.message
            continue
        for vm in vms:
            found = await classify(store, name, vm)
            report.findings.extend(found)
            await _holding_keys(backends[name], found, report)
    return report


async def _holding_keys(backend: Backend, found: list[Finding], report: GcReport) -> None:
    """List the VMs whose stored cloud-config still holds a private host key."""
    if not isinstance(backend, ChoosesHostKeys):
        return
    for finding in found:
        if finding.category not in KEYS_CHECKED:
            continue  # in flight: its deploy forgets it; others may not be ours to touch
        try:
            holds = await backend.holds_host_key(finding.ref)
        except BackendError as exc:  # listed as holding: unsure is not clean
            holds = True
            report.left.append((finding, f"could not ask about its host key: {exc.message}"))
        if holds:
            report.holding_keys.append(finding)


async def _forget_keys(
    backends: Mapping[str, Backend], report: GcReport, timeouts: Timeouts
) -> None:
    """Blank the stored private host key of each listed VM that is still there."""
    gone = {f.key for f in report.removed}
    for finding in report.holding_keys:
        backend = backends[finding.backend]
        if finding.key in gone or not isinstance(backend, ChoosesHostKeys):
            continue
        try:
            async with asyncio.timeout(timeouts.identity_s):
                await backend.forget_host_key(finding.ref)
        except (BackendError, TimeoutError) as exc:
            reason = exc.message if isinstance(exc, BackendError) else "timed out"
            report.left.append((finding, f"its private host key stays: {reason}"))
            continue
        report.keys_forgotten.append(finding)


async def dry_run(store: Store, backends: Mapping[str, Backend], scope: Sequence[str]) -> GcReport:
    report = await survey(store, backends, scope)
    await store.gc_runs.record(report.scope, [f.key for f in report.orphans], applied=False)
    return report


async def apply(
    store: Store,
    backends: Mapping[str, Backend],
    scope: Sequence[str],
    timeouts: Timeouts,
    window_s: float,
) -> GcReport:
    """Remove the orphans a recent dry run of the same scope listed; refuse without one."""
    wanted = tuple(sorted(scope))
    listed = await store.gc_runs.last_dry_run(wanted, since=utcnow() - timedelta(seconds=window_s))
    if listed is None:
        minutes = f"{window_s / 60:g}"
        raise UserError(
            f"No dry run of this scope ({', '.join(wanted)}) in the last {minutes} minutes. "
            "Run `deploybot gc` without --apply first, read what it lists, then apply."
        )
    report = await survey(store, backends, wanted)
    report.applied = True
    for finding in report.orphans:
        if finding.key not in listed:
            report.left.append((finding, "not in the dry run: run the dry run again"))
            continue
        if finding.vm.lock:  # removing it would wait for the lock, then fail: say why now
            report.locked.append(finding)
            continue
        try:
            await remove_vm(backends[finding.backend], finding.ref, timeouts)
        except (BackendError, TimeoutError) as exc:
            reason = exc.message if isinstance(exc, BackendError) else str(exc) or "timed out"
            report.left.append((finding, f"removal failed: {reason}"))
            continue
        except asyncio.CancelledError:
            raise
        report.removed.append(finding)
    await _forget_keys(backends, report, timeouts)
    for finding in report.findings:
        if not finding.orphan:
            report.left.append((finding, KEPT_WHY[finding.category]))
    await store.gc_runs.record(wanted, [f.key for f in report.removed], applied=True)
    return report
