"""The vSphere backend against vcsim in vCenter mode: configuration, TLS, discovery, the
clone and its NIC, identity by instance UUID, the session, cancellation, and faults."""

# mypy: disable-error-code="no-untyped-call"
# (pyvmomi is typed, but the constructors of its data objects and pyVim are not)

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import logging
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from pyVim.task import WaitForTask
from pyVmomi import vim

from backends.base import CloneSpec, NotOurVM, PermanentError, Unreachable, VMRef
from backends.vsphere import VSphereBackend, create
from backends.vsphere.config import Config
from bot.config.settings import BUNDLED_CONFIG, load_settings
from bot.models.errors import ConfigError
from tests.support.contract import IDENTITY
from tests.support.vsphere.pipeline import cloned
from tests.support.vsphere.simulator import (
    PASSWORD,
    PASSWORD_ENV,
    TEMPLATE,
    Simulated,
    TlsFiles,
    esxi_fixture,  # noqa: F401
    simulator,
    vcenter_fixture,  # noqa: F401
    vcsim_binary_fixture,  # noqa: F401
    vcsim_tls_fixture,  # noqa: F401
)

BASE = {"kind": "vsphere", "name": "vc", "host": "127.0.0.1", "user": "u"}


@pytest.fixture
async def backend(vcenter: Simulated) -> AsyncIterator[VSphereBackend]:
    vsphere = vcenter.sim.backend()
    yield vsphere
    await vsphere.close()


# --- configuration ------------------------------------------------------------------


def test_thin_excludes_eager_zeroing() -> None:
    with pytest.raises(ValidationError, match="thin_provisioned excludes eagerly_scrub"):
        Config.model_validate({**BASE, "thin_provisioned": True, "eagerly_scrub": True})
    for thin, eager, name in [
        (True, False, "thin"),
        (False, False, "thick lazy-zeroed"),
        (False, True, "thick eager-zeroed"),
    ]:
        config = Config.model_validate({**BASE, "thin_provisioned": thin, "eagerly_scrub": eager})
        assert config.disk_format == name


def test_a_ca_bundle_without_verification_is_a_contradiction(tmp_path: Path) -> None:
    (tmp_path / "ca.pem").write_text("a CA bundle\n")
    with pytest.raises(ValidationError, match="ca_bundle is set but verify_tls = false"):
        Config.model_validate({**BASE, "verify_tls": False, "ca_bundle": tmp_path / "ca.pem"})
    with pytest.raises(ValidationError, match=r"missing\.pem does not exist"):
        Config.model_validate({**BASE, "ca_bundle": tmp_path / "missing.pem"})


def test_the_settings_file_takes_a_vsphere_backend_and_names_a_bad_key(tmp_path: Any) -> None:
    entry = {**BASE, "eagerly_scrub": True}
    with pytest.raises(ConfigError, match=r"backends\.0: .*thin_provisioned excludes"):
        load_settings(BUNDLED_CONFIG, backends=[entry], defaults={"backend": "vc"})
    fine = load_settings(
        BUNDLED_CONFIG, backends=[BASE], defaults={"backend": "vc"}, database=str(tmp_path / "d")
    )
    assert isinstance(fine.backends[0], Config) and fine.backends[0].verify_tls


def test_create_names_the_missing_password_variable() -> None:
    config = Config.model_validate({**BASE, "password_env": "VC_LAB_PASSWORD"})
    with pytest.raises(PermanentError, match=r"environment variable VC_LAB_PASSWORD, which is"):
        create(config, {})


async def test_without_the_ca_the_certificate_is_refused(vcenter: Simulated) -> None:
    """Verification is on by default: vcsim's certificate comes from a CA nobody trusts."""
    untrusting = create(
        Config.model_validate(vcenter.sim.config(ca_bundle=None)), {PASSWORD_ENV: "p"}
    )
    try:
        with pytest.raises(PermanentError, match=r"certificate of 127\.0\.0\.1:\d+ is not tr") as e:
            await untrusting.templates()
        assert 'set ca_bundle = "/path/to/ca.pem" in [[backends]] vcenter' in e.value.message
    finally:
        await untrusting.close()


async def test_turning_verification_off_is_logged(
    vcenter: Simulated, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    insecure = create(
        Config.model_validate(vcenter.sim.config(ca_bundle=None, verify_tls=False)),
        {PASSWORD_ENV: PASSWORD},
    )
    try:
        assert [t.name for t in await insecure.templates()] == [TEMPLATE]
    finally:
        await insecure.close()
    assert "TLS certificate verification is OFF" in caplog.text
    assert PASSWORD not in caplog.text


# --- discovery --------------------------------------------------------------------


async def test_discovery(vcenter: Simulated, backend: VSphereBackend) -> None:
    assert await backend.is_vcenter()
    (template,) = await backend.templates()
    assert (template.name, template.storage) == (TEMPLATE, "LocalDS_0")
    (store,) = await backend.storages()
    assert store.name == "LocalDS_0" and store.total_bytes >= store.free_bytes > 0
    networks = {n.name: n.distributed for n in await backend.networks()}
    assert networks["VM Network"] is False and networks["DC0_DVPG0"] is True
    placements = {p.name: p.kind for p in await backend.placements()}
    assert placements == {"DC0_C0": "cluster", "DC0_H0": "host"}


async def test_templates_narrowed_by_folder_or_annotation(vcenter: Simulated) -> None:
    sim = vcenter.sim
    other = sim.make_template("DC0_H0_VM1", "debian-12")
    folder = sim.datacenter.vmFolder.CreateFolder("golden")
    WaitForTask(folder.MoveIntoFolder_Task([other]))
    everything = sim.backend()
    in_folder = sim.backend(template_folder="golden")
    annotated = sim.backend(template_annotation="deploybot template")
    try:
        assert [t.name for t in await everything.templates()] == ["debian-12", TEMPLATE]
        assert [t.name for t in await in_folder.templates()] == ["debian-12"]
        assert [t.name for t in await annotated.templates()] == [TEMPLATE]
    finally:
        for b in (everything, in_folder, annotated):
            await b.close()


async def test_an_unknown_template_or_placement_is_named_with_the_choices(
    backend: VSphereBackend,
) -> None:
    with pytest.raises(PermanentError, match=rf"'centos-5' does not exist .*have: {TEMPLATE}"):
        await backend.prepare_clone(CloneSpec("jvs0002", "web01", "centos-5"))
    with pytest.raises(PermanentError, match=r"'DC9' is not a cluster or host .*DC0_C0, DC0_H0"):
        await backend.prepare_clone(CloneSpec("jvs0002", "web01", TEMPLATE, placement="DC9"))


# --- the clone ----------------------------------------------------------------------


async def test_prepare_clone_creates_nothing(vcenter: Simulated, backend: VSphereBackend) -> None:
    before = vcenter.sim.vms()
    ref = await backend.prepare_clone(CloneSpec("jvs0003", "web01", TEMPLATE))
    assert vcenter.sim.vms() == before
    assert ref.placement == "DC0_C0"


async def test_the_clone_carries_uuid_tag_pool_and_distributed_nic(
    vcenter: Simulated, backend: VSphereBackend
) -> None:
    ref = await cloned(backend)
    vm = vcenter.sim.vm(ref.vm_id)
    assert vm is not None and vm.name == "web01"
    assert vm.config.instanceUuid == ref.vm_id
    assert "deploybot-jvs0001" in vm.config.annotation.splitlines()
    assert vm.resourcePool.owner.name == "DC0_C0"  # the pool; vSphere chose the host
    (nic,) = [
        d for d in vm.config.hardware.device if isinstance(d, vim.vm.device.VirtualEthernetCard)
    ]
    pg = next(n for n in vcenter.sim.datacenter.network if n.name == "DC0_DVPG0")
    assert isinstance(
        nic.backing, vim.vm.device.VirtualEthernetCard.DistributedVirtualPortBackingInfo
    )
    assert nic.backing.port.portgroupKey == pg.key
    assert nic.backing.port.switchUuid == pg.config.distributedVirtualSwitch.uuid


async def test_a_standard_network_is_named(vcenter: Simulated) -> None:
    backend = vcenter.sim.backend(network="VM Network")
    try:
        ref = await cloned(backend)
    finally:
        await backend.close()
    vm = vcenter.sim.vm(ref.vm_id)
    (nic,) = [
        d for d in vm.config.hardware.device if isinstance(d, vim.vm.device.VirtualEthernetCard)
    ]
    backing: Any = nic.backing
    assert isinstance(backing, vim.vm.device.VirtualEthernetCard.NetworkBackingInfo)
    assert backing.deviceName == "VM Network"
    assert backing.network is not None and backing.network.name == "VM Network"


async def test_growing_the_disk_twice_for_one_request_grows_it_once(
    vcenter: Simulated, backend: VSphereBackend
) -> None:
    """A retried grow (its answer lost) must not add the space a second time."""
    ref = await cloned(backend)

    def capacity_kb() -> int:
        vm = vcenter.sim.vm(ref.vm_id)
        return next(
            d.capacityInKB
            for d in vm.config.hardware.device
            if isinstance(d, vim.vm.device.VirtualDisk)
        )

    before = capacity_kb()
    await backend.grow_disk(ref, 3)
    await backend.grow_disk(ref, 3)
    assert capacity_kb() == before + 3 * 1024 * 1024


async def test_a_growth_target_inherited_from_the_template_is_not_this_jobs(
    vcenter: Simulated, backend: VSphereBackend
) -> None:
    """A template converted from a deployed VM hands its clones that VM's growth target
    (a clone copies extraConfig): the clone's own growth must still happen."""
    ref = await cloned(backend)
    vm = vcenter.sim.vm(ref.vm_id)
    (disk,) = [d for d in vm.config.hardware.device if isinstance(d, vim.vm.device.VirtualDisk)]
    before = disk.capacityInKB
    inherited = vim.option.OptionValue(key="deploybot.grow.target_kb", value=f"jold001:{before}")
    WaitForTask(vm.ReconfigVM_Task(vim.vm.ConfigSpec(extraConfig=[inherited])))
    await backend.grow_disk(ref, 2)
    (disk,) = [d for d in vm.config.hardware.device if isinstance(d, vim.vm.device.VirtualDisk)]
    assert disk.capacityInKB == before + 2 * 1024 * 1024


# --- identity and safety -------------------------------------------------------------


async def test_the_vm_is_found_by_instance_uuid_after_a_rename(
    vcenter: Simulated, backend: VSphereBackend
) -> None:
    ref = await cloned(backend)
    vm = vcenter.sim.vm(ref.vm_id)
    WaitForTask(vm.Rename_Task("renamed-by-someone"))
    # Someone else's VM now carries the old name: it must not be mistaken for ours.
    impostor = next(
        v for v in vcenter.sim.datacenter.vmFolder.childEntity if v.name == "DC0_H0_VM1"
    )
    WaitForTask(impostor.Rename_Task("web01"))
    info = await backend.find_vm(ref)
    assert info is not None and info.name == "renamed-by-someone"
    assert [v.vm_id for v in await backend.find_by_name("web01")] == [impostor.config.instanceUuid]
    await backend.destroy(ref)
    assert await backend.find_vm(ref) is None
    assert impostor.config.instanceUuid in vcenter.sim.vms()


async def test_a_vm_without_our_tag_is_left_alone(
    vcenter: Simulated, backend: VSphereBackend
) -> None:
    theirs = next(v for v in vcenter.sim.datacenter.vmFolder.childEntity if v.name == "DC0_H0_VM1")
    ref = VMRef(theirs.config.instanceUuid, "jvs0005")
    for move in (backend.power_off, backend.destroy, backend.power_on):
        with pytest.raises(NotOurVM, match="does not carry tag deploybot-jvs0005"):
            await move(ref)
    with pytest.raises(NotOurVM):
        await backend.apply_identity(ref, IDENTITY)
    assert theirs.runtime.powerState == "poweredOn"
    assert ref.vm_id in vcenter.sim.vms()


async def test_destroying_a_running_vm_fails_with_the_uuid_left_behind(
    backend: VSphereBackend,
) -> None:
    ref = await cloned(backend)
    await backend.power_on(ref)
    with pytest.raises(PermanentError, match=f"instance UUID {ref.vm_id}.*running") as failed:
        await backend.destroy(ref)
    assert failed.value.vm_id == ref.vm_id


async def test_refusals_and_failed_tasks_carry_the_fault(
    vcenter: Simulated, backend: VSphereBackend
) -> None:
    """A template (tagged as ours here) cannot be started: vSphere refuses the call. Nor
    can its hardware change: that task runs and fails. Both faults become the error."""
    uuid = next(u for u, name in vcenter.sim.vms().items() if name == TEMPLATE)
    vm = vcenter.sim.vm(uuid)
    WaitForTask(vm.ReconfigVM_Task(vim.vm.ConfigSpec(annotation="deploybot-jvs0006")))
    ref = VMRef(uuid, "jvs0006")
    with pytest.raises(PermanentError, match="cannot powerOn a template"):
        await backend.power_on(ref)
    history = len(vcenter.sim.task_history())
    with pytest.raises(PermanentError, match="NotSupported") as failed:
        await backend.apply_identity(ref, IDENTITY)
    assert failed.value.vm_id == uuid
    assert vcenter.sim.task_history()[history:] == ["VirtualMachine.reconfigVm"]


# --- the session ----------------------------------------------------------------------


async def test_an_expired_session_is_logged_in_again(
    vcenter: Simulated, backend: VSphereBackend
) -> None:
    await backend.templates()
    manager = vcenter.sim.content.sessionManager
    user = vcenter.sim.config()["user"]
    (session,) = [s.key for s in manager.sessionList if s.userName == user]
    manager.TerminateSession([session])
    assert [t.name for t in await backend.templates()] == [TEMPLATE]
    assert backend.api_calls()["Login"] == 2


async def test_a_caller_that_gives_up_stops_the_wait_and_leaves_no_collector(
    vcenter: Simulated, backend: VSphereBackend
) -> None:
    ref = await cloned(backend, "silent01")
    vcenter.guests.silent.add("silent01")
    await backend.apply_identity(ref, _named("silent01"))
    await backend.power_on(ref)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.5):
            await backend.wait_for_address(ref, None)
    # The long poll was ended rather than left to run out its 30 s slice.
    assert loop.time() - started < 5
    calls = backend.api_calls()
    assert calls["CancelWaitForUpdates"] == 1
    # Its filter went (those of ended tasks may stay: they send nothing more); the
    # collector waits for the next waiter.
    assert calls["DestroyPropertyFilter"] == 1


def _named(hostname: str) -> Any:

    return dataclasses.replace(
        IDENTITY, hostname=hostname, address=ipaddress.IPv4Interface("127.0.20.9/24")
    )


async def test_a_clone_whose_caller_gives_up_has_finished_when_the_call_returns(
    vcsim_binary: Path, vcsim_tls: TlsFiles, tmp_path: Path
) -> None:
    """The step timeout lands while the clone is in flight (vcsim holds it for 1.5 s):
    the call returns only once vSphere is done, so the rollback finds and removes it."""
    with simulator(vcsim_binary, vcsim_tls, tmp_path, esx=False, delay="CloneVM_Task=1500") as slow:
        before = slow.sim.vms()
        backend = slow.sim.backend()
        try:
            spec = CloneSpec("jvs0007", "web01", TEMPLATE)
            ref = await backend.prepare_clone(spec)
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.3):
                    await backend.clone(spec, ref)
            assert ref.vm_id in slow.sim.vms()
            await backend.power_off(ref)
            await backend.destroy(ref)
        finally:
            await backend.close()
        assert slow.sim.vms() == before


async def test_a_server_that_does_not_answer_is_unreachable(vcenter: Simulated) -> None:
    """Refused connections are `Unreachable`: the job waits for the server, says so, and
    carries on when it is back."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    gone = vcenter.sim.backend(port=closed_port)
    try:
        with pytest.raises(Unreachable, match=f"127.0.0.1:{closed_port} does not answer"):
            await gone.templates()
    finally:
        await gone.close()
