"""The NIC model of an OS profile on Proxmox, against the fake API (which checks every
request against the real schema, `net[n]` property strings included): `net0` gets the
profile's model in the identity step with its MAC, bridge, VLAN tag and firewall kept;
without a profile model the template's stays; a bad model stops the configuration."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from backends.base import CloneSpec, VMRef
from backends.proxmox import ProxmoxBackend
from backends.proxmox.vmconfig import nic_with
from bot.app.runtime import running_deployer
from bot.config.settings import BUNDLED_CONFIG, load_settings
from bot.models import Job, JobState
from bot.models.errors import ConfigError
from bot.requests.grammar import parse
from bot.requests.parsed import DeployArgs
from tests.support.deployer import Recorder
from tests.support.fakepve import testing
from tests.support.fakepve.schema import ApiSchema
from tests.support.fakepve.server import FakePVE, Tls
from tests.support.fakepve.testing import config_data, make_backend, pve_settings, start_fake
from tests.support.proxmox import IDENTITY, free_port

pve = testing.pve
pve_schema = testing.pve_schema
pve_tls = testing.pve_tls

CONFIG = "/nodes/{node}/qemu/{vmid}/config"


async def identity_of(backend: ProxmoxBackend, template: str = "ubuntu-24.04") -> VMRef:
    spec = CloneSpec("jnic001", "web01", template)
    ref = await backend.prepare_clone(spec)
    await backend.clone(spec, ref)
    await backend.apply_identity(ref, IDENTITY)
    return ref


def net0(fake: FakePVE, vmid: int | str) -> str:
    return fake.cluster.vms[int(vmid)].config["net0"]


def mac_of(line: str) -> str:
    return line.split(",")[0].split("=")[1]


def sent_net0(fake: FakePVE) -> list[str | None]:
    return [r.params.get("net0") for r in fake.sent("POST", CONFIG)]


async def test_the_profile_model_replaces_only_the_model(pve: FakePVE) -> None:
    pve.cluster.vms[9000].config["net0"] = "virtio=BC:24:11:00:00:AA,bridge=vmbr0,firewall=1,tag=20"
    backend = make_backend(pve, os_profiles={"ubuntu": {"nic_model": "e1000"}})
    try:
        ref = await identity_of(backend)
    finally:
        await backend.close()
    line = net0(pve, ref.vm_id)
    assert line == f"e1000={mac_of(line)},bridge=vmbr0,firewall=1,tag=20"
    assert mac_of(line) != "BC:24:11:00:00:AA"  # the clone's own MAC, kept
    assert sent_net0(pve) == [line]  # sent once, in the identity step's config change


async def test_without_a_model_the_templates_nic_stays(pve: FakePVE) -> None:
    """The default used to be virtio for every profile, which turned an e1000 template
    (a Windows guest without virtio drivers, say) into a VM with no network."""
    pve.cluster.vms[9000].config["net0"] = "e1000=BC:24:11:00:00:AB,bridge=vmbr0,tag=20"
    backend = make_backend(pve)
    try:
        ref = await identity_of(backend)
    finally:
        await backend.close()
    assert net0(pve, ref.vm_id).startswith("e1000=") and net0(pve, ref.vm_id).endswith(",tag=20")
    assert sent_net0(pve) == [None]  # nothing to change: net0 not sent at all


@pytest.mark.parametrize("model", ["virtio", "vmxnet3", "rtl8139"])
async def test_each_model_passes_the_schema(pve: FakePVE, model: str) -> None:
    pve.cluster.vms[9000].config["net0"] = "e1000=BC:24:11:00:00:AC,bridge=vmbr0"
    backend = make_backend(pve, os_profiles={"ubuntu": {"nic_model": model}})
    try:
        ref = await identity_of(backend)
    finally:
        await backend.close()
    assert net0(pve, ref.vm_id).startswith(f"{model}=")


def test_the_long_spelling_is_read_and_rewritten() -> None:
    line = "model=virtio,macaddr=BC:24:11:00:00:AD,bridge=vmbr0,firewall=1"
    assert nic_with(line, "e1000", None) == "e1000=BC:24:11:00:00:AD,bridge=vmbr0,firewall=1"
    assert nic_with(line, "virtio", None) is None  # nothing to change
    assert nic_with(line, None, "vmbr1") == "virtio=BC:24:11:00:00:AD,bridge=vmbr1,firewall=1"
    assert nic_with("bogus=1,bridge=vmbr0", "e1000", None) is None  # not read: left alone


async def test_a_deploy_with_the_profiles_model_reaches_ssh(
    pve_schema: ApiSchema, pve_tls: Tls, tmp_path: Path
) -> None:
    async with start_fake(pve_schema, pve_tls, ssh_port=free_port()) as fake:
        job = await deployed(fake, tmp_path)
        assert job.state is JobState.SUCCEEDED, job.error
        assert net0(fake, str(job.vm_id)).startswith("e1000=")


async def deployed(pve: FakePVE, tmp_path: Path) -> Job:
    """One whole deploy (the guest's sshd answers) with an e1000 profile for ubuntu."""
    profiles = {"ubuntu": {"nic_model": "e1000"}}
    settings = pve_settings(tmp_path, pve, backends=[config_data(pve, os_profiles=profiles)])
    backend = make_backend(pve, os_profiles=profiles)
    async with running_deployer(settings, Recorder(), backends={"pve": backend}) as deployer:
        args = parse("web01 127.0.10.50")
        assert isinstance(args, DeployArgs)
        job = await deployer.request_deploy(args, "alice")
        await deployer.drain()
        return (await deployer.status(job.id)).job


@pytest.mark.parametrize(
    ("profile", "fragment"),
    [
        (
            {"nic_model": "virtio-net"},
            "backends.1.os_profiles.win.nic_model: 'virtio-net' is not a NIC model deploybot "
            "sets on Proxmox: use one of virtio, e1000, vmxnet3, rtl8139, or leave nic_model "
            "out to keep the template's own NIC",
        ),
        ({"nic_model": 3}, "is not a NIC model deploybot sets on Proxmox"),
    ],
)
def test_a_bad_model_names_the_key_and_the_choices(profile: dict[str, Any], fragment: str) -> None:
    entry = {
        "kind": "proxmox",
        "name": "pve",
        "host": "pve.example",
        "os_profiles": {"win": profile},
    }
    with pytest.raises(ConfigError) as caught:
        load_settings(BUNDLED_CONFIG, backends=[{"kind": "sim", "name": "sim"}, entry])
    assert fragment in str(caught.value)
