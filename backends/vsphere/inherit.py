# mypy: disable-error-code="no-untyped-call"
# (pyvmomi is typed, but the constructors of its data objects are not)
"""What a VM created on a standalone ESXi host inherits from its template.

vCenter's clone copies the template's .vmx, so a clone keeps every setting; a created
VM has only what its ConfigSpec says. `settings` restates the template's settings as
ConfigSpec fields (devices are `specs`' part: the NIC and disk controllers keep the
template's models there), so that the created VM matches a clone of the same template:
guest OS, hardware version, firmware, boot options, flags, the CPU/memory hot-plug and
tools settings, and the extraConfig keys, except those that belong to the template
itself (`inherited_extra`).
"""

from __future__ import annotations

import re
from typing import Any

from pyVmomi import vim

# extraConfig keys a new VM must not inherit (vmx keys are case-insensitive):
NOT_INHERITED = re.compile(
    # the guest's identity: written from the deploy's own Identity instead
    r"guestinfo\..*"
    # the template's BIOS and location UUIDs and its instance UUID (vc.uuid): two VMs
    # with one BIOS UUID share a machine-id source, and vCenter would see a duplicate
    r"|uuid\..*|vc\.uuid|viv\..*"
    # the template's MACs: the new NIC has its own (set in the create spec)
    r"|ethernet\d+\.(generatedAddress|generatedAddressOffset|address|addressType)"
    # files in the template's folder and the state of its last run, not settings
    r"|nvram|sched\.swap\.derivedName|vmxstats\.filename|migrate\..*|checkpoint\..*"
    r"|toolsInstallManager\..*"
    # derived from the CPU count, which the identity may change: the host recomputes
    # them, and a stale copy would contradict numCPUs/numCoresPerSocket
    r"|cpuid\.coresPerSocket|numa\.autosize\..*",
    re.IGNORECASE,
)

# ConfigInfo attributes a ConfigSpec takes under the same name, copied as they are.
SAME_NAME = (
    "guestId",
    "alternateGuestName",
    "version",
    "firmware",
    "nestedHVEnabled",
    "vPMCEnabled",
    "cpuHotAddEnabled",
    "cpuHotRemoveEnabled",
    "memoryHotAddEnabled",
    "memoryReservationLockedToMax",
    "guestAutoLockEnabled",
    "changeTrackingEnabled",
    "swapPlacement",
    "maxMksConnections",
    "latencySensitivity",
)
HARDWARE = ("virtualICH7MPresent", "virtualSMCPresent")
# Boot options that are settings; bootOrder names the template's device keys (the new
# VM's differ) and enterBIOSSetup is a one-time request for the template's next boot.
BOOT = ("bootDelay", "efiSecureBootEnabled", "bootRetryEnabled", "bootRetryDelay")
BOOT_LATER = ("networkBootProtocol",)  # newer API versions only
# Tools policy; the rest of ToolsConfigInfo is the template's installation state, and
# pendingCustomization a customization meant for the template.
TOOLS = (
    "afterPowerOn",
    "afterResume",
    "beforeGuestStandby",
    "beforeGuestShutdown",
    "beforeGuestReboot",
    "toolsUpgradePolicy",
    "syncTimeWithHost",
)


def inherited_extra(config: Any) -> list[Any]:
    """The template's extraConfig without the keys in NOT_INHERITED, in its order."""
    return [
        vim.option.OptionValue(key=o.key, value=o.value)
        for o in config.extraConfig or []
        if not NOT_INHERITED.fullmatch(str(o.key))
    ]


def settings(config: Any) -> dict[str, Any]:
    """ConfigSpec fields restating the template's (ConfigInfo `config`) settings; an
    unset one stays unset, so that the host's default applies as it did to the template."""
    found: dict[str, Any] = {
        name: getattr(config, name) for name in SAME_NAME if getattr(config, name, None) is not None
    }
    found |= {
        name: getattr(config.hardware, name)
        for name in HARDWARE
        if getattr(config.hardware, name, None) is not None
    }
    if config.bootOptions is not None:
        boot = _picked(config.bootOptions, BOOT + BOOT_LATER)
        found["bootOptions"] = vim.vm.BootOptions(**boot)
    if config.flags is not None:
        found["flags"] = vim.vm.FlagInfo(**_picked(config.flags, _flag_names(config.flags)))
    if config.tools is not None:
        found["tools"] = vim.vm.ToolsConfigInfo(**_picked(config.tools, TOOLS))
    found["extraConfig"] = inherited_extra(config)
    return found


def _flag_names(flags: Any) -> tuple[str, ...]:
    """FlagInfo's fields but faultToleranceType, the template's Fault Tolerance state."""
    names = (p.name for p in type(flags)._GetPropertyList())
    skip = {"dynamicType", "dynamicProperty", "faultToleranceType"}
    return tuple(n for n in names if n not in skip)


def _picked(data: Any, names: tuple[str, ...]) -> dict[str, Any]:
    """The attributes `names` of a data object that are set (and that this API has)."""
    return {n: v for n in names if (v := getattr(data, n, None)) is not None}
