"""The task waiter against the fake Proxmox API: concurrent waits on one node share one
poll of the node's recent tasks (`GET /nodes/{node}/tasks?source=all&since=...`), which
also tells how the finished ones ended, and each wait still ends exactly as its own
task did."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from backends import troubles
from backends.proxmox import ProxmoxBackend
from backends.proxmox.api import PveApi
from backends.proxmox.apierrors import Forbidden, TaskFailed
from backends.proxmox.pacing import Pace, Pacing
from backends.proxmox.taskwatch import Upid
from tests.support.fakepve import testing
from tests.support.fakepve.server import FakePVE
from tests.support.fakepve.testing import make_backend

# The fake server's fixtures, shared by the Proxmox test modules.
pve = testing.pve
pve_schema = testing.pve_schema
pve_tls = testing.pve_tls

LIST = "/nodes/{node}/tasks"
STATUS = "/nodes/{node}/tasks/{upid}/status"
VMIDS = range(200, 220)


@pytest.fixture
async def backend(pve: FakePVE) -> AsyncIterator[ProxmoxBackend]:
    for vmid in VMIDS:
        pve.cluster.add_vm(vmid, f"vm{vmid}")
    pve.cluster.timings.config_s = 0.3  # long enough for many polls at 5 ms .. 50 ms
    proxmox = make_backend(pve)
    yield proxmox
    await proxmox.close()


async def start_config(api: PveApi, vmid: int) -> str:
    """A config change on a VM: a task of type qmconfig, `config_s` long."""
    upid = await api.post(f"nodes/pve1/qemu/{vmid}/config", "config", description=f"n{vmid}")
    return str(upid)


async def start_resize(api: PveApi, vmid: int) -> str:
    upid = await api.put(f"nodes/pve1/qemu/{vmid}/resize", "resize", disk="scsi0", size="+1G")
    return str(upid)


def polling_ended(api: PveApi) -> bool:
    return api.polling_nodes() == []


async def test_concurrent_waits_share_one_list_poll(backend: ProxmoxBackend, pve: FakePVE) -> None:
    api = backend.api
    upids = [await start_config(api, vmid) for vmid in VMIDS]
    results = await asyncio.gather(*(api.wait_task(u, "config") for u in upids))
    assert results == ["OK"] * len(upids)
    assert all(pve.cluster.tasks[u].exitstatus == "OK" for u in upids)
    lists, statuses = pve.sent("GET", LIST), pve.sent("GET", STATUS)
    assert all(r.params["source"] == "all" and r.status == 200 for r in lists)
    oldest = min(pve.cluster.tasks[u].starttime for u in upids)
    # From the oldest waited-for task on; later, once it finished, from the oldest left
    # (the 20 tasks may start across a second boundary on a busy machine).
    assert lists[0].params["since"] == str(oldest)
    assert all(int(r.params["since"]) >= oldest for r in lists)
    assert len(lists) + len(statuses) == api.task_polls
    # On their own, 20 waits of 0.3 s at 5 ms .. 50 ms would have sent ~20 polls each
    # (~400); together one list per half interval, which also carries each finished
    # task's status; only a wait left alone at the end asks its own task.
    assert 3 < len(lists) < 100
    assert len({r.path_params["upid"] for r in statuses}) <= 1
    assert polling_ended(api)


async def test_a_failing_task_among_them_still_fails(backend: ProxmoxBackend, pve: FakePVE) -> None:
    api = backend.api
    upids = [await start_config(api, vmid) for vmid in VMIDS[:5]]
    pve.inject("config", "task_error", message="disk full")
    failing = await start_config(api, VMIDS[5])
    upids += [await start_config(api, vmid) for vmid in VMIDS[6:10]]
    waits = [api.wait_task(u, f"config {u}", vm_id=u) for u in [*upids, failing]]
    results = await asyncio.gather(*waits, return_exceptions=True)
    assert results[:-1] == ["OK"] * len(upids)
    failure = results[-1]
    assert isinstance(failure, TaskFailed)
    assert failure.exitstatus == "disk full" and failure.vm_id == failing
    assert failure.message == (
        f"config {failing} failed: disk full (task log: starting task qmconfig {VMIDS[5]})"
    )
    assert len(pve.sent("GET", LIST)) > 0
    # The list said how each one ended; only a wait left alone at the end asks its own.
    assert len({r.path_params["upid"] for r in pve.sent("GET", STATUS)}) <= 1
    assert polling_ended(api)


async def test_a_cancelled_wait_leaves_the_others_waiting(
    backend: ProxmoxBackend, pve: FakePVE
) -> None:
    api = backend.api
    pve.cluster.timings.resize_s = 0.05
    short = await start_resize(api, VMIDS[0])
    upids = [await start_config(api, vmid) for vmid in VMIDS[1:8]]
    quick = asyncio.create_task(api.wait_task(short, "resize"))
    waits = [asyncio.create_task(api.wait_task(u, "config")) for u in upids]
    assert await quick == "OK"  # the others are still running: config takes 0.3 s
    assert all(pve.cluster.tasks[u].exitstatus is None for u in upids)
    listed_before = len(pve.sent("GET", LIST))
    waits[0].cancel()
    waits[3].cancel()
    done = await asyncio.gather(*waits, return_exceptions=True)
    assert isinstance(done[0], asyncio.CancelledError)
    assert isinstance(done[3], asyncio.CancelledError)
    assert [done[i] for i in (1, 2, 4, 5, 6)] == ["OK"] * 5
    assert all(pve.cluster.tasks[upids[i]].exitstatus == "OK" for i in (1, 2, 4, 5, 6))
    assert len(pve.sent("GET", LIST)) > listed_before  # the shared poll went on
    assert polling_ended(api)
    # A wait after the watcher ended starts it again.
    assert await api.wait_task(await start_config(api, VMIDS[9]), "config") == "OK"
    assert polling_ended(api)


async def test_a_task_never_listed_ends_by_its_own_status(
    backend: ProxmoxBackend, pve: FakePVE
) -> None:
    """A just-started task may not be listed yet: absence alone does not end its wait."""
    api = backend.api
    hidden = await start_config(api, VMIDS[0])
    pve.cluster.unlisted.add(hidden)  # running all along, never in the active list
    pve.inject("config", "task_error", message="hidden failure")
    hidden_failing = await start_config(api, VMIDS[1])
    pve.cluster.unlisted.add(hidden_failing)
    others = [await start_config(api, vmid) for vmid in VMIDS[2:6]]

    async def wait_hidden() -> float:
        assert await api.wait_task(hidden, "config") == "OK"
        return asyncio.get_running_loop().time()

    waits = [
        wait_hidden(),
        api.wait_task(hidden_failing, "config"),
        *(api.wait_task(u, "config") for u in others),
    ]
    results = await asyncio.gather(*waits, return_exceptions=True)
    task = pve.cluster.tasks[hidden]
    assert isinstance(results[0], float)
    assert task.ended_s is not None and task.ended_s <= results[0]
    assert isinstance(results[1], TaskFailed) and results[1].exitstatus == "hidden failure"
    assert results[2:] == ["OK"] * len(others)
    # Each list poll that missed it meant one status question, not an early end.
    hidden_polls = [r for r in pve.sent("GET", STATUS) if r.path_params["upid"] == hidden]
    assert len(hidden_polls) > 1
    assert polling_ended(api)


async def test_a_task_that_ends_before_it_is_listed(backend: ProxmoxBackend, pve: FakePVE) -> None:
    api = backend.api
    pve.cluster.timings.resize_s = 0.0
    upids = [await start_config(api, vmid) for vmid in VMIDS[:4]]
    instant = await start_resize(api, VMIDS[4])
    await pve.cluster.tasks[instant].done.wait()  # over before any list could show it
    results = await asyncio.gather(*(api.wait_task(u, "t") for u in [instant, *upids]))
    assert results == ["OK"] * 5
    assert all(instant != r.params.get("upid") for r in pve.sent("GET", LIST))
    assert polling_ended(api)


async def test_a_lone_wait_costs_what_it_did(backend: ProxmoxBackend, pve: FakePVE) -> None:
    api = backend.api
    assert await api.wait_task(await start_config(api, VMIDS[0]), "config") == "OK"
    assert pve.sent("GET", LIST) == []
    assert len(pve.sent("GET", STATUS)) == api.task_polls


async def test_an_unreachable_list_poll_is_retried(backend: ProxmoxBackend, pve: FakePVE) -> None:
    api = backend.api
    upids = [await start_config(api, vmid) for vmid in VMIDS[:4]]
    pve.inject("tasks", "error", times=2, status=595, message="no route to host")
    results = await asyncio.gather(*(api.wait_task(u, "config") for u in upids))
    assert results == ["OK"] * 4
    assert [r.status for r in pve.sent("GET", LIST)][:3] == [595, 595, 200]


async def test_the_fake_lists_tasks_by_source(backend: ProxmoxBackend, pve: FakePVE) -> None:
    api = backend.api
    done = await start_config(api, VMIDS[0])
    await api.wait_task(done, "config")
    running = await start_config(api, VMIDS[1])
    active = await api.get("nodes/pve1/tasks", source="active")
    assert [t["upid"] for t in active] == [running]
    fields = {"upid", "node", "pid", "pstart", "starttime", "type", "id", "user", "status"}
    assert set(active[0]) == fields and active[0]["status"] == "RUNNING"
    archive = await api.get("nodes/pve1/tasks", source="archive", typefilter="qmconfig")
    assert [(t["upid"], t["status"]) for t in archive] == [(done, "OK")]
    assert "endtime" in archive[0]
    every = await api.get("nodes/pve1/tasks", source="all", vmid=VMIDS[1])
    assert [t["upid"] for t in every] == [running]
    began = pve.cluster.tasks[running].starttime
    since = await api.get("nodes/pve1/tasks", source="all", since=began)
    assert running in [t["upid"] for t in since]
    assert await api.get("nodes/pve1/tasks", source="all", since=began + 1) == []
    assert await api.get("nodes/pve2/tasks", source="all") == []
    await api.wait_task(running, "config")


async def test_a_wait_counts_from_the_answer_that_started_the_task(
    backend: ProxmoxBackend, pve: FakePVE
) -> None:
    """A busy event loop may take its time to resume the coroutine that sent a start; the
    task's clock still starts when the answer arrived, so its looks are not that late."""
    api = backend.api
    upid = await api.post(f"nodes/pve1/qemu/{VMIDS[0]}/config", "config", description="x")
    assert isinstance(upid, Upid) and upid.answered_at <= asyncio.get_running_loop().time()
    await pve.cluster.tasks[str(upid)].done.wait()
    # Expected to take 60 s; as if its answer had come 60 s ago: the first look is due
    # now, not in a minute.
    pace = Pace(Pacing({"config": 60.0}), "config", "t")
    late = Upid(str(upid), upid.answered_at - 60.0)
    async with asyncio.timeout(10):
        assert await api.wait_task(late, "config", pace=pace) == "OK"
    assert len(pve.sent("GET", STATUS)) == 1


async def test_a_task_list_answering_500_for_a_while_fails_no_wait(
    backend: ProxmoxBackend, pve: FakePVE
) -> None:
    """Issue 25, item 12: the list answering 500 ("unable to read task index") for a
    while, and every task ended meanwhile: each wait still ends by its task's status,
    and its caller is told what the failed reads said."""
    api = backend.api
    upids = [await start_config(api, vmid) for vmid in VMIDS[:3]]
    pve.inject("tasks", "error", for_s=0.5, message="unable to read task index")
    told: list[str] = []
    with troubles.told(told):
        results = await asyncio.gather(*(api.wait_task(u, "copy template") for u in upids))
    assert results == ["OK"] * 3
    statuses = [r.status for r in pve.sent("GET", LIST)]
    assert statuses[0] == 500 and 200 in statuses, statuses
    assert told and told[-1] == (
        "listing the tasks of node pve1: unable to read task index "
        "(asking again: the task runs on regardless)"
    )
    # The failed looks teach nothing: the tasks' ends were seen late.
    assert polling_ended(api)


async def test_one_500_on_a_task_status_read_fails_no_wait(
    backend: ProxmoxBackend, pve: FakePVE
) -> None:
    api = backend.api
    pacing = Pacing()
    pve.inject("task_status", "error", message="unable to read task index")
    upid = await start_config(api, VMIDS[0])
    assert await api.wait_task(upid, "config", pace=Pace(pacing, "config", "t")) == "OK"
    assert [r.status for r in pve.sent("GET", STATUS)][:2] == [500, 200]
    assert pacing.expected_s("config", "t") is None  # a missed look: nothing learnt


async def test_a_failing_task_still_fails_after_failed_reads(
    backend: ProxmoxBackend, pve: FakePVE
) -> None:
    api = backend.api
    pve.inject("config", "task_error", message="disk full")
    upid = await start_config(api, VMIDS[0])
    pve.inject("task_status", "error", times=2, message="unable to read task index")
    with pytest.raises(TaskFailed, match="disk full"):
        await api.wait_task(upid, "config")


async def test_a_permanent_refusal_of_the_task_list_still_fails_every_wait(
    backend: ProxmoxBackend, pve: FakePVE
) -> None:
    api = backend.api
    upids = [await start_config(api, vmid) for vmid in VMIDS[:2]]
    pve.inject("tasks", "error", status=403, message="Permission check failed (Sys.Audit)")
    results = await asyncio.gather(
        *(api.wait_task(u, "config") for u in upids), return_exceptions=True
    )
    assert all(isinstance(r, Forbidden) for r in results), results
