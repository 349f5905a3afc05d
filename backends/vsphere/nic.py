# mypy: disable-error-code="no-untyped-call"
# (pyvmomi is typed, but the constructors of its data objects are not)
"""Which NIC model a deploy gives its VM on vSphere, and whether the template's guest
can drive it.

The unit is the OS profile, as on Proxmox: `os_profiles.<name>.nic_model` in the
backend's entry, where a template's profile is `template_os[<template>]`, else its guest
OS family (from `config.guestId`: ubuntu, debian, el, windows, ...). No profile, or no
`nic_model` in it: the template's own NIC class, as before.

vmxnet adapters (vmxnet, vmxnet2, vmxnet3) are paravirtual: the guest needs VMware
Tools (open-vm-tools) to drive them, and a template without Tools gets a VM that boots
with no network, an error nobody sees from outside. Whether Tools are installed is read
from the template while it is off, so:

* `guest.toolsVersionStatus2` is vSphere's verdict on the Tools version it last saw in
  the guest, kept while the VM is off: `guestToolsNotInstalled` means none was ever
  seen; `guestToolsUnmanaged` is open-vm-tools (the distribution's package).
* `config.tools.toolsVersion` is that version itself (0: none), read when the status is
  empty (vcsim never fills it).
* `guest.toolsStatus` is not used: deprecated since API 4.0, and it says
  "toolsNotRunning" for a powered-off VM whose Tools were never installed
  (fog/fog-vsphere#30, which saw `toolsVersionStatus2 = guestToolsNotInstalled` beside it).

Tools installed in a template that was never booted since are not known to vSphere:
it reports them once the template has run with them (the advice says so).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, field_validator
from pyVmomi import vim

from backends import advice
from backends.vsphere.conn import Props

NicModel = Literal["vmxnet3", "e1000e", "e1000"]
MODELS: tuple[str, ...] = ("vmxnet3", "e1000e", "e1000")
CARD = vim.vm.device.VirtualEthernetCard
CLASSES: dict[str, Any] = {
    "vmxnet3": vim.vm.device.VirtualVmxnet3,
    "e1000e": vim.vm.device.VirtualE1000e,
    "e1000": vim.vm.device.VirtualE1000,
}
# Most specific first: VirtualVmxnet3 and VirtualVmxnet2 are subclasses of VirtualVmxnet.
_NAMES = (
    (vim.vm.device.VirtualVmxnet3, "vmxnet3"),
    (vim.vm.device.VirtualVmxnet2, "vmxnet2"),
    (vim.vm.device.VirtualVmxnet, "vmxnet"),
    (vim.vm.device.VirtualE1000e, "e1000e"),
    (vim.vm.device.VirtualE1000, "e1000"),
    (vim.vm.device.VirtualPCNet32, "pcnet32"),
    (vim.vm.device.VirtualSriovEthernetCard, "sriov"),
)
NEEDS_TOOLS = frozenset({"vmxnet3", "vmxnet2", "vmxnet"})
# What `inventory.os_family` answers: profiles named so need no `template_os` entry.
FAMILIES = ("ubuntu", "debian", "windows", "sles", "photon", "coreos", "el", "other")
TOOLS_PATHS = ("guest.toolsVersionStatus2", "config.tools.toolsVersion")
NOT_INSTALLED = "guestToolsNotInstalled"
# A NIC-less template gets this class when the deploy names a network (`specs`): every
# guest drives it.
FALLBACK = "e1000e"


class OSProfile(BaseModel):
    """What a vSphere OS profile says: the NIC model (None: the template's own)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    nic_model: NicModel | None = None

    @field_validator("nic_model", mode="before")
    @classmethod
    def _known(cls, value: object) -> object:
        if value is not None and value not in MODELS:
            raise ValueError(advice.nic_model_choice(value, MODELS, "vSphere"))
        return value


def check_template_os(template_os: dict[str, str], profiles: dict[str, OSProfile]) -> None:
    """A `template_os` entry must name a profile that exists (or a family, which
    keeps the template's NIC when no profile is configured for it)."""
    for template, profile in template_os.items():
        if profile not in profiles and profile not in FAMILIES:
            raise ValueError(advice.unknown_profile(template, profile, [*profiles, *FAMILIES]))


def model_name(device: Any) -> str:
    """vmxnet3, e1000e, ... for a NIC device; its class name for one not listed."""
    for cls, name in _NAMES:
        if isinstance(device, cls):
            return name
    return type(device).__name__


def nics(devices: list[Any]) -> list[Any]:
    return [d for d in devices if isinstance(d, CARD)]


def tools_installed(props: Props) -> bool:
    """Whether vSphere has seen VMware Tools in the (powered-off) template: see above."""
    status = str(props.get("guest.toolsVersionStatus2") or "")
    if status:
        return status != NOT_INSTALLED
    return bool(props.get("config.tools.toolsVersion"))


@dataclass(frozen=True)
class NicFit:
    """The NIC model a deploy of one template sets (None: keep the template's class),
    the profile that said so, and why the guest could not drive it (None: it can)."""

    model: str | None
    profile: str
    problem: str | None = None


def fit(
    backend: str,
    profiles: dict[str, OSProfile],
    template_os: dict[str, str],
    template: str,
    family: str,
    props: Props,
) -> NicFit:
    """The NIC model for `template` (its properties `props`: devices and TOOLS_PATHS)
    and whether its guest can drive it."""
    name = template_os.get(template, family)
    profile = profiles.get(name)
    model = profile.nic_model if profile else None
    own = nics(props.get("config.hardware.device") or [])
    effective: str
    if model is not None:
        effective, why = model, f"os_profiles.{name}.nic_model"
    elif own:
        effective, why = model_name(own[0]), "the template's own NIC, kept"
    else:
        effective, why = FALLBACK, ""
    problem = None
    if effective in NEEDS_TOOLS and not tools_installed(props):
        problem = advice.nic_needs_tools(backend, template, effective, why, name)
    return NicFit(model, name, problem)
