"""`deploybot template gc`: retire template versions nobody needs any more.

A rebuild publishes a new version and renames the old one `NAME-vN`; the old one stays
while VMs depend on it (Proxmox linked clones use its base volumes) and as a way back.
This lists, per backend, the templates deploybot built and says which may go:

* `retire`: an older version (not the current one) of this installation, that no VM
  uses, beyond the newest `[images] keep_previous` older versions of its name;
* `failed_build`: a template whose build failed or was cancelled (its rollback could not
  remove it), or whose build this database never recorded (tagged by this installation);

and which stay: the current version, one in use (`used_by`), one of the kept previous
versions, another installation's.

Removal follows `deploybot gc`'s two-step rule: a dry run first, and an `--apply` of the
same scope within the window removes only what that dry run listed and still qualifies.
A retired build's row moves to `retired`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

from backends.base import Backend, VMRef
from backends.building import BuildsTemplates, TemplateVersion
from bot.models import utcnow
from bot.models.builds import ACTIVE_BUILD_STATES, BuildState
from bot.models.errors import BackendError, UserError
from store.db import Store

REMOVABLE = ("retire", "failed_build")
KEPT_WHY = {
    "current": "the current version",
    "in_use": "VMs use it",
    "kept_previous": "kept as a way back ([images] keep_previous)",
    "other_installation": "another installation's",
    "building": "its build is under way",
}


@dataclass(frozen=True)
class Verdict:
    backend: str
    version: TemplateVersion
    category: str

    @property
    def key(self) -> str:
        build = self.version.mark.job_id if self.version.mark else "-"
        return f"{self.backend}:{self.version.vm_id}:{build}"

    @property
    def removable(self) -> bool:
        return self.category in REMOVABLE


@dataclass
class RetireReport:
    scope: tuple[str, ...]
    applied: bool
    verdicts: list[Verdict] = field(default_factory=list)
    removed: list[Verdict] = field(default_factory=list)
    left: list[tuple[Verdict, str]] = field(default_factory=list)
    unreachable: dict[str, str] = field(default_factory=dict)


def _scope_key(scope: Sequence[str]) -> list[str]:
    """Recorded apart from `deploybot gc`'s runs of the same backends."""
    return [f"template:{name}" for name in sorted(scope)]


async def _category(store: Store, v: TemplateVersion, older_rank: int, keep: int) -> str:
    if v.mark is None or v.mark.installation != store.installation_id:
        return "other_installation"
    build = await store.builds.get(v.mark.job_id)
    if build is not None and build.state in ACTIVE_BUILD_STATES:
        return "building"
    if build is None or build.state in (BuildState.FAILED, BuildState.CANCELLED):
        return "failed_build"
    if v.current:
        return "current"
    if v.used_by:
        return "in_use"
    return "kept_previous" if older_rank < keep else "retire"


async def survey(
    store: Store, backends: Mapping[str, Backend], scope: Sequence[str], keep: int
) -> RetireReport:
    report = RetireReport(tuple(sorted(scope)), applied=False)
    for name in report.scope:
        backend = backends[name]
        if not isinstance(backend, BuildsTemplates):
            continue
        try:
            versions = await backend.template_versions()
        except BackendError as exc:
            report.unreachable[name] = exc.message
            continue
        ranks: dict[str, int] = {}
        for v in sorted(versions, key=lambda v: (v.base_name, -v.version)):
            rank = ranks.get(v.base_name, 0)
            if not v.current:
                ranks[v.base_name] = rank + 1
            report.verdicts.append(Verdict(name, v, await _category(store, v, rank, keep)))
    return report


async def dry_run(
    store: Store, backends: Mapping[str, Backend], scope: Sequence[str], keep: int
) -> RetireReport:
    report = await survey(store, backends, scope, keep)
    keys = [v.key for v in report.verdicts if v.removable]
    await store.gc_runs.record(_scope_key(report.scope), keys, applied=False)
    return report


async def apply(
    store: Store,
    backends: Mapping[str, Backend],
    scope: Sequence[str],
    keep: int,
    window_s: float,
    timeout_s: float,
) -> RetireReport:
    """Remove what a recent dry run of the same scope listed and still qualifies."""
    wanted = tuple(sorted(scope))
    since = utcnow() - timedelta(seconds=window_s)
    listed = await store.gc_runs.last_dry_run(_scope_key(wanted), since=since)
    if listed is None:
        raise UserError(
            f"No dry run of `deploybot template gc` for {', '.join(wanted)} in the last "
            f"{window_s / 60:g} minutes. Run it without --apply first, read what it lists, "
            "then apply."
        )
    report = await survey(store, backends, wanted, keep)
    report.applied = True
    for verdict in report.verdicts:
        if not verdict.removable:
            report.left.append((verdict, KEPT_WHY[verdict.category]))
        elif verdict.key not in listed:
            report.left.append((verdict, "not in the dry run: run the dry run again"))
        else:
            await _remove(store, backends[verdict.backend], verdict, report, timeout_s)
    await store.gc_runs.record(_scope_key(wanted), [v.key for v in report.removed], applied=True)
    return report


async def _remove(
    store: Store, backend: Backend, verdict: Verdict, report: RetireReport, timeout_s: float
) -> None:
    assert isinstance(backend, BuildsTemplates) and verdict.version.mark is not None
    v, mark = verdict.version, verdict.version.mark
    ref = VMRef(v.vm_id, mark.job_id, v.placement, mark.installation)
    try:
        async with asyncio.timeout(timeout_s):
            await backend.destroy_template(ref)
    except (BackendError, TimeoutError) as exc:
        reason = exc.message if isinstance(exc, BackendError) else "timed out"
        report.left.append((verdict, f"removal failed: {reason}"))
        return
    report.removed.append(verdict)
    await store.builds.move(mark.job_id, [BuildState.PUBLISHED], BuildState.RETIRED)
