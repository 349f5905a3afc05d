"""The fake Proxmox API itself: it must answer like the real one, or the backend tests
prove nothing. These requests are sent raw (aiohttp), marked exempt from the session's
"every request the backend sent is valid" check, since many are wrong on purpose."""

from __future__ import annotations

import re
import ssl
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote, quote_plus

import aiohttp
import pytest

from tests.support.fakepve import testing
from tests.support.fakepve.raw import Raw, linked_clone, shape_problems
from tests.support.fakepve.server import FakePVE
from tests.support.fakepve.testing import start_fake

# The fake server's fixtures, shared by the Proxmox test modules.
pve = testing.pve
pve_schema = testing.pve_schema
pve_tls = testing.pve_tls

UPID = re.compile(r"UPID:pve1:[0-9A-F]{8}:[0-9A-F]{8}:[0-9A-F]{8}:(\w+):(\d+):root@pam!deploybot:")
KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHb2vLw3m3tqB7m4m1Lr2x9n0l3r3x8uGk2ycJ0b1Fq8 a@b"


@pytest.fixture
async def raw(pve: FakePVE) -> AsyncIterator[Raw]:
    context = ssl.create_default_context(cafile=str(pve.tls.ca_path))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=context)) as session:
        yield Raw(session, pve)


# --- parameter verification ------------------------------------------------------------


CFG = "/nodes/pve1/qemu/100/config"
CLONE = "/nodes/pve1/qemu/9000/clone"
RESIZE = "/nodes/pve1/qemu/100/resize"
NET0 = "virtio=BC:24:11:00:00:01,bridge=vmbr0,tag=5000"
# method, path, parameters, the parameter named in `errors`, its message
BAD = [
    ("POST", CFG, {"bogus": "1"}, "bogus", "property is not defined in schema"),
    ("POST", CFG, {"cores": "two"}, "cores", "type check ('integer') failed - got 'two'"),
    ("POST", CFG, {"cores": "0"}, "cores", "minimum value of 1"),
    ("GET", "/cluster/resources", {"type": "vms"}, "type", "enumeration 'vm, storage, node, sdn'"),
    ("PUT", RESIZE, {"disk": "scsi0", "size": "ten"}, "size", "does not match the regex pattern"),
    ("PUT", RESIZE, {"disk": "hda", "size": "+1G"}, "disk", "enumeration"),
    ("POST", CLONE, {"name": "x"}, "newid", "property is missing and it is not optional"),
    ("POST", CLONE, {"newid": "99"}, "newid", "minimum value of 100"),
    (
        "POST",
        CFG,
        {"name": "web_01"},
        "name",
        "invalid format - value does not look like a valid DNS",
    ),
    ("POST", CFG, {"sshkeys": KEY}, "sshkeys", "invalid format - invalid urlencoded string"),
    ("POST", CFG, {"sshkeys": quote_plus(KEY)}, "sshkeys", "invalid urlencoded string"),
    ("POST", CFG, {"ipconfig0": "ip=10.0.0.5,gw=10.0.0.1"}, "ipconfig0", "ip: value does not"),
    ("POST", CFG, {"ipconfig0": "gw=10.0.0.1"}, "ipconfig0", "gateway specified without"),
    ("POST", CFG, {"ipconfig0": "ip=10.0.0.5/24,gateway=10.0.0.1"}, "ipconfig0", "gateway: prop"),
    ("POST", CFG, {"nameserver": "10.0.0.2 dns.example"}, "nameserver", "unable to parse address"),
    ("POST", CFG, {"tags": "deploybot jx!"}, "tags", "invalid characters in tag"),
    ("POST", CFG, {"cpu": "x86-64-v9"}, "cpu", "CPU model 'x86-64-v9' does not exist"),
    ("POST", CFG, {"net0": NET0}, "net0", "tag: value must have a maximum value of 4094"),
    ("POST", CFG, {"memory": "big"}, "memory", "current: type check ('integer') failed"),
    ("DELETE", "/nodes/pve1/qemu/100", {"purge": "maybe"}, "purge", "check ('boolean') failed"),
    ("GET", "/nodes/pve 1/storage", {}, "node", "valid node name"),
]


@pytest.mark.parametrize(("method", "path", "params", "param", "message"), BAD)
async def test_bad_parameters_get_the_real_400(
    raw: Raw, method: str, path: str, params: dict[str, str], param: str, message: str
) -> None:
    answer = await raw.call(method, path, params)
    assert answer.status == 400
    assert answer.reason == "Parameter verification failed."
    assert answer.body["data"] is None
    assert message in answer.body["errors"][param], answer.body


async def test_good_identity_values_pass_the_schema(raw: Raw) -> None:
    params = {
        "ipconfig0": "ip=10.0.0.5/24,gw=10.0.0.1",
        "sshkeys": quote(f"{KEY}\n{KEY}", safe=""),
        "nameserver": "10.0.0.2 10.0.0.3",
        "cpu": "x86-64-v2-AES",
        "agent": "1",
        "memory": "2048",
        "net0": "virtio=BC:24:11:00:00:01,bridge=vmbr1",
        "tags": "deploybot-jabc123;prod",
        "ciupgrade": "0",
    }
    answer = await raw.call("POST", "/nodes/pve1/qemu/100/config", params)
    assert answer.status == 200, answer
    assert (await raw.task(answer.data))["exitstatus"] == "OK"
    config = (await raw.call("GET", "/nodes/pve1/qemu/100/config")).data
    assert config["ipconfig0"] == "ip=10.0.0.5/24,gw=10.0.0.1"
    assert config["ciupgrade"] == "0"


async def test_a_server_before_8_0_does_not_know_ciupgrade(pve_schema: Any, pve_tls: Any) -> None:
    async with start_fake(pve_schema, pve_tls, release="7.4") as old:
        context = ssl.create_default_context(cafile=str(old.tls.ca_path))
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=context)) as session:
            answer = await Raw(session, old).call(
                "POST", "/nodes/pve1/qemu/100/config", {"ciupgrade": "0"}
            )
            version = (await Raw(session, old).call("GET", "/version")).data
    assert answer.status == 400
    assert "not defined in schema" in answer.body["errors"]["ciupgrade"]
    assert version["release"] == "7.4"


async def test_an_unknown_route_is_not_implemented(raw: Raw) -> None:
    answer = await raw.call("GET", "/nodes/pve1/qemu/100/snapshot")
    assert answer.status == 501
    assert answer.reason == "Method 'GET /nodes/pve1/qemu/100/snapshot' not implemented"


# --- auth ------------------------------------------------------------------------------


async def test_auth_token_ticket_and_csrf(raw: Raw) -> None:
    assert (await raw.call("GET", "/version", auth=False)).status == 401
    bad = await raw.call("GET", "/version", auth=False, headers={"Authorization": raw.token + "x"})
    assert (bad.status, bad.reason) == (401, "authentication failure")
    wrong = await raw.call(
        "POST", "/access/ticket", {"username": "root@pam", "password": "nope"}, auth=False
    )
    assert wrong.status == 401
    login = await raw.call(
        "POST",
        "/access/ticket",
        {"username": "root@pam", "password": raw.fake.password},
        auth=False,
    )
    ticket, csrf = login.data["ticket"], login.data["CSRFPreventionToken"]
    assert ticket.startswith("PVE:root@pam:") and login.data["clustername"] == "lab"
    cookies = {"PVEAuthCookie": ticket}
    assert (await raw.call("GET", "/version", auth=False, cookies=cookies)).status == 200
    write = {"description": "x"}
    no_csrf = await raw.call(
        "POST", "/nodes/pve1/qemu/100/config", write, auth=False, cookies=cookies
    )
    assert (no_csrf.status, no_csrf.reason) == (401, "Permission denied - invalid csrf token")
    ok = await raw.call(
        "POST",
        "/nodes/pve1/qemu/100/config",
        write,
        auth=False,
        cookies=cookies,
        headers={"CSRFPreventionToken": csrf},
    )
    assert ok.status == 200
    raw.fake.advance_clock(7201)  # tickets live two hours
    assert (await raw.call("GET", "/version", auth=False, cookies=cookies)).status == 401


# --- tasks, locks and refusals ----------------------------------------------------------


async def test_clone_task_lock_and_task_endpoints(raw: Raw) -> None:
    raw.fake.cluster.timings.clone_s = 30.0  # stays locked for the whole test
    upid = await linked_clone(raw)
    match = UPID.fullmatch(upid)
    assert match is not None and match.groups() == ("qmclone", "9000"), upid
    status = (await raw.call("GET", f"/nodes/pve1/tasks/{upid}/status")).data
    assert status["status"] == "running" and "exitstatus" not in status
    config = (await raw.call("GET", "/nodes/pve1/qemu/120/config")).data
    assert config["lock"] == "clone" and config["name"] == "t1"
    refused = await raw.call("POST", "/nodes/pve1/qemu/120/config", {"cores": "2"})
    assert (refused.status, refused.reason, refused.body) == (
        500,
        "VM is locked (clone)",
        {"data": None},
    )
    # A destroy's checks of the lock run in its task (qemu-server's destroy_vm), which
    # first waits for the file lock the clone holds all along: in vain here.
    delete = await raw.call("DELETE", "/nodes/pve1/qemu/120", {"purge": "1"})
    assert delete.status == 200 and UPID.fullmatch(delete.data)
    assert (await raw.task(delete.data))["exitstatus"] == (
        "can't lock file '/var/lock/qemu-server/lock-120.conf' - got timeout"
    )
    log = (await raw.call("GET", f"/nodes/pve1/tasks/{upid}/log")).data
    assert log[0] == {
        "n": 1,
        "t": "create linked clone of drive scsi0 (local-lvm:base-9000-disk-0)",
    }


async def test_a_task_ends_ok_and_its_config_is_unlocked(raw: Raw) -> None:
    upid = await linked_clone(raw)
    status = await raw.task(upid)
    assert (status["status"], status["exitstatus"]) == ("stopped", "OK")
    config = (await raw.call("GET", "/nodes/pve1/qemu/120/config")).data
    assert "lock" not in config and config["scsi0"].startswith(
        "local-lvm:base-9000-disk-0/vm-120-disk-0"
    )
    log = (await raw.call("GET", f"/nodes/pve1/tasks/{upid}/log")).data
    assert log[-1]["t"] == "TASK OK"


async def test_clone_refusals(raw: Raw) -> None:
    linked_with_storage = await raw.call(
        "POST", "/nodes/pve1/qemu/9000/clone", {"newid": "121", "storage": "bulk-nfs"}
    )
    assert (linked_with_storage.status, linked_with_storage.reason) == (
        500,
        "parameter 'storage' not allowed for linked clones",
    )
    taken = await raw.call("POST", "/nodes/pve1/qemu/9000/clone", {"newid": "100"})
    assert taken.reason == "unable to create VM 100: config file already exists"
    local_to_other_node = await raw.call(
        "POST", "/nodes/pve1/qemu/9000/clone", {"newid": "122", "target": "pve2", "full": "1"}
    )
    assert local_to_other_node.reason == "can't clone VM to node 'pve2' (VM uses local storage)"
    full = await raw.call(
        "POST", "/nodes/pve1/qemu/9000/clone", {"newid": "123", "full": "1", "storage": "bulk-nfs"}
    )
    assert (await raw.task(full.data))["exitstatus"] == "OK"
    config = (await raw.call("GET", "/nodes/pve1/qemu/123/config")).data
    assert config["scsi0"].startswith("bulk-nfs:vm-123-disk-0")


async def test_plain_lvm_has_no_linked_clones_and_the_failed_clone_is_removed(raw: Raw) -> None:
    upid = await linked_clone(raw, 124, template=9004)
    status = await raw.task(upid)
    assert (
        status["exitstatus"]
        == "clone failed: Linked clone feature is not supported for 'thick-lvm:base-9004-disk-0'"
    )
    assert (await raw.call("GET", "/nodes/pve1/qemu/124/config")).reason == (
        "Configuration file 'nodes/pve1/qemu-server/124.conf' does not exist"
    )
    log = (await raw.call("GET", f"/nodes/pve1/tasks/{upid}/log")).data
    assert log[-1]["t"].startswith("TASK ERROR: clone failed: Linked clone feature")


async def test_a_running_vm_cannot_be_destroyed(raw: Raw) -> None:
    answer = await raw.call("DELETE", "/nodes/pve1/qemu/100", {"purge": "1"})
    assert (answer.status, answer.reason) == (500, "VM 100 is running - destroy failed")


async def test_nextid_checks_and_races(raw: Raw) -> None:
    assert (await raw.call("GET", "/cluster/nextid")).data == "101"
    taken = await raw.call("GET", "/cluster/nextid", {"vmid": "100"})
    assert taken.status == 400 and taken.body["errors"] == {"vmid": "VM 100 already exists"}
    raw.fake.inject("nextid", "race")
    assert (await raw.call("GET", "/cluster/nextid")).data == "101"
    assert 101 in raw.fake.cluster.vms  # another client took it right after
    assert (await raw.call("GET", "/cluster/nextid")).data == "102"


async def test_faults_per_endpoint(raw: Raw) -> None:
    raw.fake.inject("version", "error", message="proxy loop detected", status=503)
    raw.fake.inject(
        "resources", "lock_timeout", message="can't lock file '/etc/pve/x' - got timeout"
    )
    raw.fake.inject("nodes", "delay", delay_s=0.01)
    down = await raw.call("GET", "/version")
    assert (down.status, down.reason, down.body) == (503, "proxy loop detected", {"data": None})
    assert (
        await raw.call("GET", "/cluster/resources")
    ).reason == "can't lock file '/etc/pve/x' - got timeout"
    assert (await raw.call("GET", "/nodes")).status == 200
    assert (await raw.call("GET", "/version")).status == 200  # once only
    with pytest.raises(ValueError, match="unknown endpoint"):
        raw.fake.inject("snapshot", "error")


async def test_a_task_can_fail_or_wait_for_a_lock(raw: Raw) -> None:
    raw.fake.inject("clone", "task_lock_timeout")
    status = await raw.task(await linked_clone(raw, 125))
    assert (
        status["exitstatus"]
        == "clone failed: can't lock file '/var/lock/qemu-server/lock-125.conf' - got timeout"
    )
    assert 125 not in raw.fake.cluster.vms
    raw.fake.inject("config", "task_error", message="hotplug problem")
    upid = (await raw.call("POST", "/nodes/pve1/qemu/100/config", {"cores": "4"})).data
    assert (await raw.task(upid))["exitstatus"] == "hotplug problem"
    assert raw.fake.cluster.vms[100].config["cores"] == "2"


# --- the guest ---------------------------------------------------------------------------


async def test_the_agent_answers_some_time_after_start(raw: Raw) -> None:
    await raw.task(await linked_clone(raw))
    ip = {"ipconfig0": "ip=10.0.0.50/24,gw=10.0.0.1", "agent": "1"}
    await raw.task((await raw.call("POST", "/nodes/pve1/qemu/120/config", ip)).data)
    path = "/nodes/pve1/qemu/120/agent/network-get-interfaces"
    assert (await raw.call("GET", path)).reason == "VM 120 is not running"
    await raw.task((await raw.call("POST", "/nodes/pve1/qemu/120/status/start")).data)
    early = await raw.call("GET", path)
    assert (early.status, early.reason) == (500, "QEMU guest agent is not running")
    vm = raw.fake.cluster.vms[120]
    assert vm.boot is not None
    await vm.boot
    result = (await raw.call("GET", path)).data["result"]
    names = [i["name"] for i in result]
    addresses = [a["ip-address"] for i in result for a in i["ip-addresses"]]
    assert names == ["lo", "docker0", "eth0"]
    assert addresses[:3] == ["127.0.0.1", "::1", "172.17.0.1"]
    assert addresses[3].startswith("fe80::") and addresses[4] == "10.0.0.50"
    assert not raw.fake.cluster.guest.listening(120)  # 10.0.0.50 is not loopback: no sshd


async def test_no_agent_configured_and_the_stop_closes_sshd(pve_schema: Any, pve_tls: Any) -> None:
    async with start_fake(pve_schema, pve_tls, ssh_port=2299) as fake:
        context = ssl.create_default_context(cafile=str(fake.tls.ca_path))
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=context)) as session:
            raw = Raw(session, fake)
            await raw.task(await linked_clone(raw))
            ip = {"ipconfig0": "ip=127.0.10.61/24,gw=127.0.10.1", "agent": "0"}
            await raw.task((await raw.call("POST", "/nodes/pve1/qemu/120/config", ip)).data)
            await raw.task((await raw.call("POST", "/nodes/pve1/qemu/120/status/start")).data)
            vm = fake.cluster.vms[120]
            assert vm.boot is not None
            await vm.boot
            agent = await raw.call("GET", "/nodes/pve1/qemu/120/agent/network-get-interfaces")
            assert agent.reason == "No QEMU guest agent configured"
            assert fake.cluster.guest.listening(120)
            await raw.task((await raw.call("POST", "/nodes/pve1/qemu/120/status/stop")).data)
            assert not fake.cluster.guest.listening(120)


@pytest.mark.parametrize(
    "path",
    [
        "/version",
        "/cluster/status",
        "/cluster/resources",
        "/nodes",
        "/nodes/pve1/status",
        "/nodes/pve1/capabilities/qemu/cpu",
        "/nodes/pve1/storage",
        "/nodes/pve1/network",
        "/nodes/pve1/qemu/100/status/current",
    ],
)
async def test_answers_have_the_shape_the_schema_promises(raw: Raw, path: str) -> None:
    route = raw.fake.schema.route(path)
    assert route is not None
    info = raw.fake.schema.method(route.template, "GET")
    assert info is not None
    answer = await raw.call("GET", path)
    assert answer.status == 200
    assert shape_problems(info["returns"], answer.data) == []


async def test_task_answers_have_the_promised_shape(raw: Raw) -> None:
    upid = await linked_clone(raw)
    await raw.task(upid)
    for path in (f"/nodes/pve1/tasks/{upid}/status", f"/nodes/pve1/tasks/{upid}/log"):
        route = raw.fake.schema.route(path)
        assert route is not None
        info = raw.fake.schema.method(route.template, "GET")
        assert info is not None
        assert shape_problems(info["returns"], (await raw.call("GET", path)).data) == []
