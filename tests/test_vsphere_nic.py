"""The NIC model per OS profile on vSphere, against vcsim: a vCenter clone and an ESXi
create get the profile's adapter class with their MAC and network, the template's own
class without a profile, and a vmxnet3 NIC for a template whose guest has no VMware
Tools is refused before anything exists, at request time too, naming the fix."""

# mypy: disable-error-code="no-untyped-call"
# (pyvmomi is typed, but the constructors of its data objects and pyVim are not)

from __future__ import annotations

import tomllib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from pyVim.task import WaitForTask
from pyVmomi import vim

from backends.base import CloneSpec, PermanentError, Template
from backends.vsphere.config import Config
from bot.config.settings import BUNDLED_CONFIG, load_settings
from bot.models import JobState
from bot.models.errors import ConfigError, RequestInvalid
from bot.requests.admission import problems_at_start
from bot.requests.grammar import parse
from bot.requests.parsed import DeployArgs
from handlers.messages.reports import templates
from tests.support.contract import IDENTITY
from tests.support.vsphere.pipeline import Sshd, deploy, deployer_for, vsphere_settings
from tests.support.vsphere.simulator import (
    TEMPLATE,
    TOOLS_VERSION,
    Simulated,
    decode,
    esxi_fixture,  # noqa: F401
    vcenter_fixture,  # noqa: F401
    vcsim_binary_fixture,  # noqa: F401
    vcsim_tls_fixture,  # noqa: F401
)

CARD = vim.vm.device.VirtualEthernetCard
# vcsim's template: guestId otherGuest (family "other"), one e1000 NIC, no Tools.
LAB = {"template_os": {TEMPLATE: "lab"}}


@pytest.fixture(name="sshd")
async def sshd_fixture() -> AsyncIterator[Sshd]:
    """The guest's SSH server, as in test_vsphere_pipeline."""
    listeners = Sshd()
    await listeners.listen("127.0.20.50")
    yield listeners
    await listeners.close()


def profile(model: str) -> dict[str, Any]:
    return {**LAB, "os_profiles": {"lab": {"nic_model": model}}}


def template_vm(lab: Simulated) -> Any:
    return next(v for v in lab.sim.datacenter.vmFolder.childEntity if v.name == TEMPLATE)


def install_tools(lab: Simulated, status: str = "") -> None:
    """The template as one that ran open-vm-tools: the Tools version vSphere saw, and
    (`status`) vSphere's verdict on it, which vcsim leaves empty unless told."""
    template = template_vm(lab)
    host = template.runtime.host
    template.MarkAsVirtualMachine(pool=host.parent.resourcePool, host=host)
    extra = [vim.option.OptionValue(key="SET.guest.toolsVersionStatus2", value=status)]
    spec = vim.vm.ConfigSpec(
        tools=vim.vm.ToolsConfigInfo(toolsVersion=TOOLS_VERSION),
        extraConfig=extra if status else [],
    )
    WaitForTask(template.ReconfigVM_Task(spec))
    template.MarkAsTemplate()


def nics(vm: Any) -> list[Any]:
    return [d for d in vm.config.hardware.device if isinstance(d, CARD)]


async def deployed(lab: Simulated, job: str, **config: Any) -> Any:
    backend = lab.sim.backend(**config)
    try:
        spec = CloneSpec(job, "web01", TEMPLATE, identity=IDENTITY)
        ref = await backend.prepare_clone(spec)
        await backend.clone(spec, ref)
    finally:
        await backend.close()
    return lab.sim.vm(ref.vm_id)


def metadata_mac(lab: Simulated, vm: Any) -> str:
    (nic,) = decode(lab.sim.extra(vm)["guestinfo.metadata"])["network"]["config"]
    return str(nic["mac_address"])


# --- the class a deploy gets --------------------------------------------------------


async def test_without_a_profile_the_clone_keeps_the_templates_nic(vcenter: Simulated) -> None:
    vm = await deployed(vcenter, "jnic001")
    (nic,) = nics(vm)
    assert type(nic) is vim.vm.device.VirtualE1000


async def test_a_clone_gets_the_profiles_class_with_its_network_and_mac(
    vcenter: Simulated,
) -> None:
    template_nic = nics(template_vm(vcenter))[0]
    vm = await deployed(vcenter, "jnic002", **profile("e1000e"))
    (nic,) = nics(vm)  # replaced, not added beside the template's
    assert type(nic) is vim.vm.device.VirtualE1000e
    # On the backend's network (a distributed portgroup), and the metadata names its MAC.
    assert isinstance(nic.backing, CARD.DistributedVirtualPortBackingInfo)
    assert metadata_mac(vcenter, vm) == str(nic.macAddress).lower()
    assert nic.addressType == template_nic.addressType


async def test_every_nic_of_a_clone_changes_class_and_the_first_stays_first(
    vcenter: Simulated,
) -> None:
    """A template with two NICs: both are replaced in order, so the metadata still names
    the first one's MAC and the second keeps its own network."""
    template = template_vm(vcenter)
    assert len(nics(template)) == 1
    second = vim.vm.device.VirtualE1000(
        key=-5, backing=CARD.NetworkBackingInfo(deviceName="VM Network"), addressType="generated"
    )
    host = template.runtime.host
    template.MarkAsVirtualMachine(pool=host.parent.resourcePool, host=host)
    add = vim.vm.device.VirtualDeviceSpec(operation="add", device=second)
    WaitForTask(template.ReconfigVM_Task(vim.vm.ConfigSpec(deviceChange=[add])))
    template.MarkAsTemplate()
    vm = await deployed(vcenter, "jnic008", **profile("e1000e"))
    first, other = nics(vm)
    assert type(first) is type(other) is vim.vm.device.VirtualE1000e
    assert isinstance(first.backing, CARD.DistributedVirtualPortBackingInfo)
    assert isinstance(other.backing, CARD.NetworkBackingInfo)
    assert other.backing.deviceName == "VM Network"
    assert metadata_mac(vcenter, vm) == str(first.macAddress).lower()


@pytest.mark.parametrize("status", ["", "guestToolsUnmanaged"])
async def test_vmxnet3_for_a_template_with_tools(vcenter: Simulated, status: str) -> None:
    install_tools(vcenter, status)
    backend = vcenter.sim.backend(**profile("vmxnet3"))
    try:
        (template,) = [t for t in await backend.templates() if t.name == TEMPLATE]
    finally:
        await backend.close()
    assert template.problem is None
    vm = await deployed(vcenter, "jnic003", **profile("vmxnet3"))
    (nic,) = nics(vm)
    assert type(nic) is vim.vm.device.VirtualVmxnet3
    assert metadata_mac(vcenter, vm) == str(nic.macAddress).lower()


async def test_the_esxi_create_gets_the_profiles_class(esxi: Simulated) -> None:
    vm = await deployed(esxi, "jnic004", **profile("e1000e"))
    (nic,) = nics(vm)
    assert type(nic) is vim.vm.device.VirtualE1000e
    assert nic.addressType == "manual" and metadata_mac(esxi, vm) == str(nic.macAddress).lower()
    install_tools(esxi)
    vm = await deployed(esxi, "jnic005", **profile("vmxnet3"))
    (nic,) = nics(vm)
    assert type(nic) is vim.vm.device.VirtualVmxnet3
    assert metadata_mac(esxi, vm) == str(nic.macAddress).lower()


# --- refusals -------------------------------------------------------------------------


@pytest.mark.parametrize("status", ["", "guestToolsNotInstalled"])
async def test_vmxnet3_without_tools_is_refused_before_anything_exists(
    vcenter: Simulated, status: str
) -> None:
    if status:  # a Tools version, but vSphere's verdict says none: the verdict wins
        install_tools(vcenter, status)
    before = vcenter.sim.vms()
    backend = vcenter.sim.backend(**profile("vmxnet3"))
    try:
        (template,) = [t for t in await backend.templates() if t.name == TEMPLATE]
        with pytest.raises(PermanentError) as refused:
            await backend.prepare_clone(CloneSpec("jnic006", "web01", TEMPLATE))
    finally:
        await backend.close()
    assert refused.value.message == template.problem
    message = refused.value.message
    assert f"template {TEMPLATE} on vcenter would get a vmxnet3 NIC" in message
    assert "os_profiles.lab.nic_model" in message and "no Tools installed" in message
    assert "Install open-vm-tools in the template" in message
    assert 'nic_model = "e1000e" in [backends.os_profiles.lab]' in message
    assert "try again" not in message
    assert vcenter.sim.vms() == before


async def test_serve_warns_of_the_template_at_start(vcenter: Simulated) -> None:
    backends = {"vcenter": vcenter.sim.backend(**profile("vmxnet3"))}
    try:
        (problem,) = await problems_at_start(backends)
    finally:
        await backends["vcenter"].close()
    assert problem.startswith(f"backend vcenter: template {TEMPLATE} on vcenter would get")


async def test_a_templates_own_vmxnet3_without_tools_is_refused(esxi: Simulated) -> None:
    """No profile: the template's own NIC class is what the guest gets, so it counts."""
    template = template_vm(esxi)
    (old,) = nics(template)
    new = vim.vm.device.VirtualVmxnet3(key=-3, backing=old.backing, addressType="generated")
    change = vim.vm.device.VirtualDeviceSpec
    host = template.runtime.host
    template.MarkAsVirtualMachine(pool=host.parent.resourcePool, host=host)
    spec = vim.vm.ConfigSpec(
        deviceChange=[change(operation="remove", device=old), change(operation="add", device=new)]
    )
    WaitForTask(template.ReconfigVM_Task(spec))
    template.MarkAsTemplate()
    backend = esxi.sim.backend()
    try:
        with pytest.raises(PermanentError, match="the template's own NIC, kept"):
            await backend.prepare_clone(CloneSpec("jnic007", "web01", TEMPLATE))
    finally:
        await backend.close()


async def test_the_request_is_refused_with_the_fix(
    vcenter: Simulated, sshd: Sshd, tmp_path: Path
) -> None:
    entry = vcenter.sim.config(**profile("vmxnet3"))
    settings = vsphere_settings(tmp_path, vcenter, sshd, backends=[entry])
    async with deployer_for(settings) as (deployer, _backend):
        args = parse("web01 127.0.20.50")
        assert isinstance(args, DeployArgs)
        with pytest.raises(RequestInvalid) as refused:
            await deployer.request_deploy(args, "alice")
        assert await deployer.history(10) == []  # nothing recorded
    (problem,) = refused.value.problems
    assert problem.startswith(f"template: template {TEMPLATE} on vcenter would get a vmxnet3")
    assert "open-vm-tools" in problem and "e1000e" in problem


async def test_a_deploy_with_e1000e_boots_with_its_address(
    vcenter: Simulated, sshd: Sshd, tmp_path: Path
) -> None:
    """The whole pipeline: the guest (vcsim's stand-in) finds the NIC the metadata names
    on the replaced adapter and reports its address; the SSH check connects."""
    entry = vcenter.sim.config(**profile("e1000e"))
    settings = vsphere_settings(tmp_path, vcenter, sshd, backends=[entry])
    async with deployer_for(settings) as (deployer, _backend):
        job = await deploy(deployer, "web01 127.0.20.50")
    assert job.state is JobState.SUCCEEDED, job.error
    (nic,) = nics(vcenter.sim.vm(str(job.vm_id)))
    assert type(nic) is vim.vm.device.VirtualE1000e
    assert vcenter.guests.booted[str(job.vm_id)].mac == str(nic.macAddress).lower()


# --- configuration ----------------------------------------------------------------------


def vsphere_entry(**extra: Any) -> dict[str, Any]:
    return {"kind": "vsphere", "name": "vc", "host": "vc.example", "user": "u", **extra}


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (
            {"os_profiles": {"ubuntu": {"nic_model": "vmxnet"}}},
            "backends.1.os_profiles.ubuntu.nic_model: 'vmxnet' is not a NIC model deploybot "
            "sets on vSphere: use one of vmxnet3, e1000e, e1000, or leave nic_model out",
        ),
        (
            {"template_os": {"win-2022": "windwos"}},
            "template_os sends template 'win-2022' to OS profile 'windwos', which is neither "
            "in os_profiles nor a guest OS family",
        ),
    ],
)
def test_a_bad_profile_names_the_key_and_the_choices(extra: dict[str, Any], fragment: str) -> None:
    backends = [{"kind": "sim", "name": "sim"}, vsphere_entry(**extra)]
    with pytest.raises(ConfigError) as caught:
        load_settings(BUNDLED_CONFIG, backends=backends)
    assert fragment in str(caught.value)


def test_a_family_needs_no_template_os_entry() -> None:
    config = Config.model_validate(
        vsphere_entry(
            os_profiles={"ubuntu": {"nic_model": "vmxnet3"}, "win": {"nic_model": "e1000e"}},
            template_os={"win-2022": "win", "old-rhel": "el"},
        )
    )
    assert config.os_profiles["ubuntu"].nic_model == "vmxnet3"
    assert Config.model_validate(vsphere_entry()).os_profiles == {}


def test_the_examples_profiles_in_the_bundled_config_validate() -> None:
    """The commented Proxmox and vSphere entries of the example, uncommented."""
    from backends.proxmox.config import Config as ProxmoxConfig

    text = BUNDLED_CONFIG.read_text(encoding="utf-8")
    block = text[text.index('# [[backends]]\n# kind = "vsphere"') : text.index("# Addresses")]
    lines = [line[2:] if line.startswith("# ") else "" for line in block.splitlines()]
    vsphere, proxmox = tomllib.loads("\n".join(lines))["backends"]
    assert Config.model_validate(vsphere).os_profiles["ubuntu"].nic_model == "vmxnet3"
    assert ProxmoxConfig.model_validate(proxmox).os_profiles["windows"].nic_model == "e1000"


def test_the_template_list_says_which_are_refused_and_why() -> None:
    found: dict[str, list[Template] | str] = {
        "vcenter": [Template("ubuntu", "ubuntu"), Template("old", "other", problem="NO TOOLS")]
    }
    lines = templates(found)
    assert lines[:2] == [
        "vcenter: ubuntu (ubuntu), old (other, refused)",
        "vcenter: old is refused: NO TOOLS",
    ]
