"""The fake Proxmox's guest-agent file and exec endpoints (transcribed from qemu-server's
Agent.pm into supplement.json): schema-checked requests and answers, the agent's own
errors, and the privilege model of each release (VM.Monitor before PVE 9,
VM.GuestAgent.* from 9.0)."""

from __future__ import annotations

import asyncio
import base64
import signal
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.support import mountns
from tests.support.fakepve import testing
from tests.support.fakepve.raw import Raw, linked_clone, shape_problems
from tests.support.fakepve.schema import ApiSchema
from tests.support.fakepve.server import EXEMPT_HEADER, FakePVE, Tls
from tests.support.fakepve.testing import start_fake

pve_schema = testing.pve_schema
pve_tls = testing.pve_tls

READ = "/nodes/pve1/qemu/120/agent/file-read"
WRITE = "/nodes/pve1/qemu/120/agent/file-write"
ED25519 = "/etc/ssh/ssh_host_ed25519_key.pub"


async def booted(raw: Raw) -> None:
    """VM 120, a linked clone with the agent enabled, started and its agent up."""
    await raw.task(await linked_clone(raw))
    agent = {"ipconfig0": "ip=10.0.0.50/24,gw=10.0.0.1", "agent": "1"}
    await raw.task((await raw.call("POST", "/nodes/pve1/qemu/120/config", agent)).data)
    await raw.task((await raw.call("POST", "/nodes/pve1/qemu/120/status/start")).data)
    vm = raw.fake.cluster.vms[120]
    assert vm.boot is not None
    await vm.boot


@pytest.fixture(params=["8.2", "9.0"])
async def raw(
    request: pytest.FixtureRequest, pve_schema: ApiSchema, pve_tls: Tls
) -> AsyncIterator[Raw]:
    async with start_fake(pve_schema, pve_tls, release=request.param) as fake:
        context = ssl.create_default_context(cafile=str(fake.tls.ca_path))
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=context)) as session:
            yield Raw(session, fake)


def returns(fake: FakePVE, path: str, method: str) -> dict[str, Any]:
    route = fake.schema.route(path)
    assert route is not None
    info = fake.schema.method(route.template, method)
    assert info is not None
    spec: dict[str, Any] = info["returns"]
    return spec


async def test_file_read_answers_the_guests_file_in_the_promised_shape(raw: Raw) -> None:
    await booted(raw)
    answer = await raw.call("GET", READ, {"file": ED25519})
    assert answer.status == 200, answer
    assert shape_problems(returns(raw.fake, READ, "GET"), answer.data) == []
    assert answer.data["content"] == raw.fake.cluster.vms[120].files[ED25519].decode()
    assert answer.data["content"].startswith("ssh-ed25519 AAAA")
    assert "truncated" not in answer.data  # read to its end


async def test_file_read_refuses_what_the_schema_refuses(raw: Raw) -> None:
    await booted(raw)
    missing = await raw.call("GET", READ)
    assert (missing.status, missing.body["errors"]) == (
        400,
        {"file": "property is missing and it is not optional"},
    )
    # `count` came with qemu-server 9.1.5: older servers do not know it.
    counted = await raw.call("GET", READ, {"file": ED25519, "count": "11"})
    assert counted.status == 400 and "count" in counted.body["errors"]


async def test_file_read_takes_count_from_9_1(pve_schema: ApiSchema, pve_tls: Tls) -> None:
    async with start_fake(pve_schema, pve_tls, release="9.1") as fake:
        context = ssl.create_default_context(cafile=str(fake.tls.ca_path))
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=context)) as session:
            raw = Raw(session, fake)
            await booted(raw)
            answer = await raw.call("GET", READ, {"file": ED25519, "count": "11"})
    assert answer.status == 200, answer
    assert (answer.data["content"], answer.data["truncated"]) == ("ssh-ed25519", 1)


async def test_the_agents_own_errors(raw: Raw) -> None:
    await raw.task(await linked_clone(raw))
    agent = {"ipconfig0": "ip=10.0.0.50/24,gw=10.0.0.1", "agent": "1"}
    await raw.task((await raw.call("POST", "/nodes/pve1/qemu/120/config", agent)).data)
    stopped = await raw.call("GET", READ, {"file": ED25519})
    assert (stopped.status, stopped.reason) == (500, "VM 120 is not running")
    await raw.task((await raw.call("POST", "/nodes/pve1/qemu/120/status/start")).data)
    early = await raw.call("GET", READ, {"file": ED25519})
    assert (early.status, early.reason) == (500, "QEMU guest agent is not running")
    vm = raw.fake.cluster.vms[120]
    assert vm.boot is not None
    await vm.boot
    rsa = await raw.call("GET", READ, {"file": "/etc/ssh/ssh_host_rsa_key.pub"})
    assert (rsa.status, rsa.reason) == (
        500,
        "Agent error: failed to open file '/etc/ssh/ssh_host_rsa_key.pub' (mode: 'r'): "
        "No such file or directory",
    )


async def test_file_write_then_exec(raw: Raw) -> None:
    mountns.require()  # the fake's guest runs the command in a namespace of its own
    await booted(raw)
    written = await raw.call("POST", WRITE, {"file": "/etc/ssh/cert.pub", "content": "x y\n"})
    assert (written.status, written.data) == (200, None)
    assert (await raw.call("GET", READ, {"file": "/etc/ssh/cert.pub"})).data["content"] == "x y\n"
    url = raw.fake.url + "/nodes/pve1/qemu/120/agent/exec"
    form = [("command", "systemctl"), ("command", "reload"), ("command", "ssh")]
    headers = {EXEMPT_HEADER: "1", "Authorization": raw.token}
    async with raw.session.post(url, data=form, headers=headers) as response:
        started = (await response.json())["data"]
    assert shape_problems(returns(raw.fake, url.split("json")[1], "POST"), started) == []
    status_path = WRITE.replace("file-write", "exec-status")
    status = await raw.call("GET", status_path, {"pid": str(started["pid"])})
    while not status.data["exited"]:  # the command runs in the guest meanwhile
        assert shape_problems(returns(raw.fake, status_path, "GET"), status.data) == []
        status = await raw.call("GET", status_path, {"pid": str(started["pid"])})
    assert shape_problems(returns(raw.fake, status_path, "GET"), status.data) == []
    assert status.data["exitcode"] == 0
    agent = raw.fake.cluster.machines.agents[120]  # type: ignore[attr-defined]
    assert agent.executed == [["systemctl", "reload", "ssh"]]
    # The guest's systemd took it (the fake's guest runs commands in its own /run).
    log = await raw.call("GET", READ, {"file": "/run/systemctl.log"})
    assert log.data["content"] == "systemctl reload ssh\n"
    # qemu-ga forgets a process once it told that it exited.
    again = await raw.call("GET", status_path, {"pid": str(started["pid"])})
    assert (again.status, again.reason) == (500, "Agent error: Invalid parameter 'pid'")


@pytest.mark.parametrize("revoked", ["file-read", "all"])
async def test_each_release_checks_its_own_privilege(raw: Raw, revoked: str) -> None:
    await booted(raw)
    new = raw.fake.cluster.release_tuple >= (9, 0)
    if new:
        raw.fake.acl.revoke("VM.GuestAgent.FileRead")
        if revoked == "all":
            raw.fake.acl.revoke("VM.GuestAgent.Unrestricted")
    else:
        raw.fake.acl.revoke("VM.Monitor")
    answer = await raw.call("GET", READ, {"file": ED25519})
    if new and revoked == "file-read":  # VM.GuestAgent.Unrestricted will do
        assert answer.status == 200
        return
    privileges = "VM.GuestAgent.FileRead|VM.GuestAgent.Unrestricted" if new else "VM.Monitor"
    assert (answer.status, answer.reason) == (
        403,
        f"Permission check failed (/vms/120, {privileges})",
    )


async def test_a_guests_signal_never_reaches_a_host_process(raw: Raw) -> None:
    """The guest's commands run in a PID namespace of their own: a `kill -HUP` of the pid
    in its /run/sshd.pid (here: a process of this host) finds no such process there."""
    mountns.require()
    await booted(raw)
    vm = raw.fake.cluster.vms[120]
    host = await asyncio.create_subprocess_exec("sleep", "120")
    try:
        vm.files["/run/sshd.pid"] = f"{host.pid}\n".encode()
        script = 'kill -HUP "$(cat /run/sshd.pid)" 2>/dev/null; echo "exit $? as pid $$"'
        agent = raw.fake.cluster.machines.guest_agent(120)  # type: ignore[attr-defined]
        started = await agent.ask(vm, "guest-exec", {"path": "/bin/sh", "arg": ["-c", script]})
        await agent.processes[started["pid"]].task  # the command ended
        status = await agent.ask(vm, "guest-exec-status", {"pid": started["pid"]})
        said = base64.b64decode(status["out-data"]).decode()
        assert said.strip() == "exit 1 as pid 1"  # no such process; the shell is its pid 1
    finally:
        host.terminate()
    # A SIGHUP, had it arrived, would have ended it already (-SIGHUP): it ends by ours.
    assert await host.wait() == -signal.SIGTERM


def test_a_host_without_a_bind_target_is_unavailable(tmp_path: Path) -> None:
    """The probe binds over the paths the tests bind over: a host without one says which."""
    mountns.require()
    missing = str(tmp_path / "no-such-folder")
    assert mountns.unavailable((missing,)) == (
        f"this host has no {missing} to bind a test's folder over"
    )
    assert mountns.unavailable((str(tmp_path),)) is None
