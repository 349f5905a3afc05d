"""The endpoints that change things, each a task with the real server's refusals
(`VM is locked (clone)`, `... is running - destroy failed`, linked clones refused with
`storage`, plain lvm without the clone feature, ...). What happens to the guests
themselves (disks, boots, power-offs) is `Cluster.machines`' part."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import quote, unquote

from tests.support.fakepve.call import (
    UNITS,
    Call,
    Handler,
    locked,
    size_bytes,
    size_text,
    task_locked,
)
from tests.support.fakepve.cluster import TASK_FAULTS, VM
from tests.support.fakepve.errors import ApiError, TaskError
from tests.support.fakepve.formats import ssh_keys_problem
from tests.support.fakepve.storage import FILE_TYPES as _FILE

_LINKED = frozenset({"zfspool", "lvmthin", "rbd", "btrfs"})
_SIZE = re.compile(r"(\+?)(\d+(?:\.\d+)?)([KMGT]?)")
_NOT_CONFIG = frozenset({"node", "vmid", "digest", "delete", "skiplock", "background_delay"})


async def clone(c: Call) -> Any:
    """Early checks at once (the source's config lock among them: a template being
    backed up cannot be cloned), again in the task, as qemu-server's clone_vm does."""
    cl, src = c.cluster, c.vm()
    locked(src)
    newid = int(c.params["newid"])
    if newid in cl.hidden:  # VM.Allocate on /vms/{newid}, which is someone else's
        raise ApiError(403, f"Permission check failed (/vms/{newid}, VM.Allocate)")
    if newid in cl.vms:
        raise ApiError(500, f"unable to create VM {newid}: config file already exists")
    full = c.params.get("full", "0" if src.template else "1") in ("1", "true", "yes", "on")
    if not full and "storage" in c.params:
        raise ApiError(500, "parameter 'storage' not allowed for linked clones")
    if not full and "format" in c.params:
        raise ApiError(500, "parameter 'format' not allowed for linked clones")
    target = c.params.get("target", c.node)
    cl.node(target)
    disk_key = re.search(r"order=([a-z]+\d+)", src.config.get("boot", "order=scsi0"))
    key = disk_key.group(1) if disk_key else "scsi0"
    volid, _, opts = src.config[key].partition(",")
    source = cl.storages[volid.split(":")[0]]
    dest = cl.storages.get(c.params.get("storage", source.name))
    if dest is None or "images" not in dest.content:
        raise ApiError(500, f"storage '{c.params.get('storage')}' does not exist")
    if target != c.node and not source.shared:
        raise ApiError(500, f"can't clone VM to node '{target}' (VM uses local storage)")
    linked_ok = source.type in _LINKED or (source.type in _FILE and volid.endswith(".qcow2"))
    config = {k: v for k, v in src.config.items() if k not in ("template", "lock")}
    config.update(
        name=c.params.get("name", f"Copy-of-VM-{src.config.get('name', src.vmid)}"), lock="clone"
    )
    if "description" in c.params:
        config["description"] = c.params["description"]
    if full:
        config[key] = f"{dest.name}:vm-{newid}-disk-0,{opts}"
    elif source.type in _FILE:  # local:9000/base-9000-disk-0.qcow2/101/vm-101-disk-0.qcow2
        config[key] = f"{volid}/{newid}/vm-{newid}-disk-0.qcow2,{opts}"
    else:
        config[key] = f"{volid}/vm-{newid}-disk-0,{opts}"
    config["ide2"] = f"{dest.name}:vm-{newid}-cloudinit,media=cdrom"
    config["net0"] = re.sub(r"=([0-9A-F:]{17})", f"={cl.fresh_mac()}", config.get("net0", ""))
    new = VM(newid, target, config, agent_installed=src.agent_installed)
    cl.vms[newid] = new  # exists (locked) from the start, as the real config file does

    def precheck() -> None:
        task_locked(src)
        if not full and not linked_ok:
            raise TaskError(f"clone failed: Linked clone feature is not supported for '{volid}'")

    async def finish() -> None:
        await cl.machines.cloned(src, new, full=full)  # the disk: an overlay, or a copy
        new.config.pop("lock", None)

    def remove() -> None:  # Proxmox removes the partial VM itself
        if cl.vms.get(newid) is new:
            del cl.vms[newid]

    return cl.spawn(
        c.node,
        "qmclone",
        str(src.vmid),
        c.user,
        lock_vmid=newid,
        duration_s=cl.timings.clone_full_s if full else cl.timings.clone_s,
        precheck=precheck,
        effect=finish,
        on_fail=remove,
        fault=cl.take("clone", TASK_FAULTS),
        error_prefix="clone failed: ",
        log=(
            f"create {'full' if full else 'linked'} clone of drive {key} ({volid})",
            f"transferred 0.0 B of {size_text(size_bytes(src.config[key]))} (0.00%)",
        ),
    )


def _config_changes(c: Call, vm: VM) -> Callable[[], None]:
    """Check a config change now (as the API does before forking); apply it later."""
    locked(vm)
    digest = c.params.get("digest")
    if digest is not None and digest != vm.digest():
        raise ApiError(
            500, "detected modified configuration - file changed by other user? Try again."
        )
    values = {k: v for k, v in c.params.items() if k not in _NOT_CONFIG}
    if "sshkeys" in values:
        if (problem := ssh_keys_problem(values["sshkeys"])) is not None:
            raise ApiError(500, problem)
        values["sshkeys"] = quote(unquote(values["sshkeys"]), safe="")  # stored escaped
    deleted = [k for k in re.split(r"[,;\s]+", c.params.get("delete", "")) if k]
    for key, value in values.items():
        # qemu-server's parse_net: a NIC given without a MAC gets a generated one.
        if re.fullmatch(r"net\d+", key) and "=" not in str(value).split(",")[0]:
            model, _, rest = str(value).partition(",")
            values[key] = f"{model}={c.cluster.fresh_mac()}" + (f",{rest}" if rest else "")

    def apply() -> None:
        vm.config.update(values)
        for key in deleted:
            vm.config.pop(key, None)

    return apply


async def config_async(c: Call) -> Any:
    vm = c.vm()
    apply = _config_changes(c, vm)
    cl = c.cluster
    return cl.spawn(
        c.node,
        "qmconfig",
        str(vm.vmid),
        c.user,
        lock_vmid=vm.vmid,
        duration_s=cl.timings.config_s,
        effect=apply,
        fault=cl.take("config", TASK_FAULTS),
    )


async def config_sync(c: Call) -> Any:
    vm = c.vm()
    _config_changes(c, vm)()
    return None


async def resize(c: Call) -> Any:
    cl, vm = c.cluster, c.vm()
    locked(vm)
    disk = c.params["disk"]
    if disk not in vm.config:
        raise ApiError(500, f"disk '{disk}' does not exist")
    match = _SIZE.fullmatch(c.params["size"])
    assert match is not None  # the schema pattern held
    amount = int(float(match.group(2)) * UNITS[match.group(3)])
    current = size_bytes(vm.config[disk])
    new = current + amount if match.group(1) else amount
    if new < current:
        raise ApiError(500, "shrinking disks is not supported")

    def grow() -> None:
        vm.config[disk] = re.sub(r"size=[^,]+", f"size={size_text(new)}", vm.config[disk])

    if cl.release_tuple < (8, 0):  # synchronous before 8.0: no UPID
        grow()
        return None
    return cl.spawn(
        c.node,
        "resize",
        str(vm.vmid),
        c.user,
        lock_vmid=vm.vmid,
        duration_s=cl.timings.resize_s,
        effect=grow,
        fault=cl.take("resize", TASK_FAULTS),
    )


async def start(c: Call) -> Any:
    cl, vm = c.cluster, c.vm()

    def precheck() -> None:
        if vm.running:
            raise TaskError(f"VM {vm.vmid} already running")
        if lock := vm.config.get("lock"):
            raise TaskError(f"VM is locked ({lock})")

    def boot() -> Awaitable[None]:
        return cl.machines.started(vm)

    return cl.spawn(
        c.node,
        "qmstart",
        str(vm.vmid),
        c.user,
        lock_vmid=vm.vmid,
        duration_s=cl.timings.start_s,
        precheck=precheck,
        effect=boot,
        fault=cl.take("start", TASK_FAULTS),
    )


def stopper(kind: str, endpoint: str) -> Handler:
    async def stop(c: Call) -> Any:
        cl, vm = c.cluster, c.vm()
        skiplock = c.params.get("skiplock") == "1"

        graceful = kind == "qmshutdown"
        timeout_s = float(c.params.get("timeout", "180"))
        force = c.params.get("forceStop") in ("1", "true")

        def precheck() -> None:  # qemu-server's _do_vm_stop, in the task
            if vm.running and not skiplock:
                task_locked(vm)

        def halt() -> Awaitable[None]:
            return cl.machines.halted(vm, graceful=graceful, timeout_s=timeout_s, force=force)

        return cl.spawn(
            c.node,
            kind,
            str(vm.vmid),
            c.user,
            lock_vmid=vm.vmid,
            duration_s=cl.timings.stop_s,
            precheck=precheck,
            effect=halt,
            fault=cl.take(endpoint, TASK_FAULTS),
        )

    return stop


async def destroy(c: Call) -> Any:
    """The API's early checks answer at once (HTTP 500); the config lock is checked in
    the task (qemu-server's destroy_vm), which tolerates only `suspended`."""
    cl, vm = c.cluster, c.vm()
    skiplock = c.params.get("skiplock") == "1"
    if vm.running:
        raise ApiError(500, f"VM {vm.vmid} is running - destroy failed")
    if vm.ha_managed and c.params.get("purge") not in ("1", "true"):
        raise ApiError(
            500,
            f"unable to remove VM {vm.vmid} - used in HA resources and purge parameter not set.",
        )

    def precheck() -> None:
        if vm.running:  # started again since the request was answered
            raise TaskError(f"VM {vm.vmid} is running - destroy failed")
        if not skiplock and vm.config.get("lock") != "suspended":
            task_locked(vm)

    async def remove() -> None:
        if cl.vms.get(vm.vmid) is vm:
            del cl.vms[vm.vmid]
            await cl.machines.destroyed(vm)

    return cl.spawn(
        c.node,
        "qmdestroy",
        str(vm.vmid),
        c.user,
        lock_vmid=vm.vmid,
        duration_s=cl.timings.destroy_s,
        precheck=precheck,
        effect=remove,
        fault=cl.take("delete", TASK_FAULTS),
    )


# (method, schema path) -> (fault endpoint name, handler)
