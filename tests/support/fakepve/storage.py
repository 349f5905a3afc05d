"""Storage content and VM creation: uploads (`imgcopy` tasks, checksums verified), the
content listing, deleting a volume, creating a VM whose disk is imported from an
uploaded volume (`import-from`) and converting a VM into a template. What the guests'
disks are is `Cluster.machines`' part (`imported`)."""

from __future__ import annotations

import hashlib
import re
import shutil
from pathlib import Path
from typing import Any

from tests.support.fakepve.call import Call, locked, size_text
from tests.support.fakepve.cluster import TASK_FAULTS, VM, Cluster, StorageDef
from tests.support.fakepve.errors import ApiError, TaskError

IMPORT_RELEASE = (8, 4)  # disk images as content `import`
_EXTENSIONS = {"iso": r"\.(?:iso|img)$", "import": r"\.(?:ova|qcow2|raw|vmdk)$"}
_DISK_KEY = re.compile(r"(?:scsi|virtio|sata|ide)\d+")
_NEW_DISK = re.compile(r"([^:,]+):(\d+(?:\.\d+)?)(?:,|$)")


# File storages: a disk is a file, `VMID/vm-VMID-disk-N.FORMAT` (raw unless asked).
FILE_TYPES = frozenset({"dir", "nfs", "cifs", "glusterfs"})
_FILE = FILE_TYPES


def extension_ok(content: str, name: str) -> bool:
    return bool(re.search(_EXTENSIONS.get(content, r"$^"), name))


def _storage(cl: Cluster, name: str) -> StorageDef:
    found = cl.storages.get(name)
    if found is None:
        raise ApiError(500, f"storage '{name}' does not exist")
    return found


def _content(storage: StorageDef) -> set[str]:
    return set(storage.content.split(","))


async def upload(c: Call) -> Any:
    cl = c.cluster
    storage = _storage(cl, c.path["storage"])
    content, name = c.params["content"], c.params["filename"]
    if content == "import" and cl.release_tuple < IMPORT_RELEASE:
        raise ApiError(400, "Parameter verification failed.", {"content": "upload not allowed"})
    if content not in _content(storage):
        raise ApiError(500, f"storage '{storage.name}' does not support '{content}' content")
    if not extension_ok(content, name):
        raise ApiError(500, "wrong file extension")
    if c.upload is None:
        raise ApiError(400, "Parameter verification failed.", {"filename": "no file uploaded"})
    held = c.upload.with_name(c.upload.name + ".task")  # the task's from now on
    c.upload.rename(held)
    volid = f"{storage.name}:{content}/{name}"
    target = cl.files() / "storage" / storage.name / content / name

    def finish() -> None:
        expected = c.params.get("checksum")
        if expected is not None:
            algorithm = c.params["checksum-algorithm"]
            got = hashlib.new(algorithm, held.read_bytes()).hexdigest()
            if got != expected.lower():
                held.unlink(missing_ok=True)
                raise TaskError(f"checksum mismatch: got '{got}' != expect '{expected}'")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(held, target)
        cl.volumes[volid] = target

    return cl.spawn(
        c.node,
        "imgcopy",
        "",
        c.user,
        lock_vmid=None,
        duration_s=cl.timings.config_s,
        effect=finish,
        on_fail=lambda: held.unlink(missing_ok=True),
        fault=cl.take("upload", TASK_FAULTS),
        log=(f"starting file import from: {held}", f"target file: {target}"),
    )


async def content(c: Call) -> Any:
    cl = c.cluster
    cl.node(c.node)
    storage = _storage(cl, c.path["storage"])
    wanted = c.params.get("content")
    answer: list[dict[str, Any]] = []
    for volid, path in sorted(cl.volumes.items()):
        kind = volid.split(":", 1)[1].split("/", 1)[0]
        if volid.startswith(f"{storage.name}:") and wanted in (None, kind):
            size = path.stat().st_size
            fmt = "qcow2" if volid.endswith(".qcow2") else kind
            answer.append({"volid": volid, "format": fmt, "size": size, "content": kind})
    if wanted in (None, "images"):
        for vm in sorted(cl.vms.values(), key=lambda v: v.vmid):
            for key, value in vm.config.items():
                volid = value.split(",", 1)[0]
                if not _DISK_KEY.fullmatch(key) or not volid.startswith(f"{storage.name}:"):
                    continue
                item: dict[str, Any] = {
                    "volid": volid,
                    "format": "raw",
                    "size": _size(value),
                    "vmid": vm.vmid,
                    "content": "images",
                }
                name = volid.split(":", 1)[1]
                parts = name.split("/")
                if storage.type in _FILE:  # 9000/base-9000-disk-0.qcow2[/101/vm-101-disk-0.qcow2]
                    item["format"] = parts[-1].rsplit(".", 1)[-1]
                    if len(parts) == 4:
                        item["parent"] = f"../{parts[0]}/{parts[1]}"
                elif "/" in name:  # a linked clone on lvmthin: base-9000-disk-0/vm-101-disk-0
                    item["parent"] = parts[0]
                answer.append(item)
    return answer


async def delete_volume(c: Call) -> Any:
    cl = c.cluster
    cl.node(c.node)
    _storage(cl, c.path["storage"])
    volid = c.path["volume"]
    if volid not in cl.volumes:
        raise ApiError(500, f"no such volume '{volid}'")

    def remove() -> None:
        path = cl.volumes.pop(volid, None)
        if path is not None:
            path.unlink(missing_ok=True)

    return cl.spawn(
        c.node,
        "imgdel",
        "",
        c.user,
        lock_vmid=None,
        duration_s=cl.timings.destroy_s,
        effect=remove,
        fault=cl.take("volume_delete", TASK_FAULTS),
    )


async def create_vm(c: Call) -> Any:
    """qemu-server's create_vm: new disks (`STORAGE:SIZE`, or `STORAGE:0,import-from=`)
    are allocated in the task; a missing import source is refused at once."""
    cl = c.cluster
    cl.node(c.node)
    vmid = int(c.params["vmid"])
    if vmid in cl.hidden:
        raise ApiError(403, f"Permission check failed (/vms/{vmid}, VM.Allocate)")
    if vmid in cl.vms:
        raise ApiError(500, f"unable to create VM {vmid}: config file already exists")
    config = {k: v for k, v in c.params.items() if k not in ("node", "vmid")}
    imports: dict[str, Path] = {}
    disks = 0
    for key, value in list(config.items()):
        if not _DISK_KEY.fullmatch(key):
            continue
        store, _, rest = value.split(",", 1)[0].partition(":")
        if rest == "cloudinit":
            _images(cl, store)
            config[key] = f"{store}:vm-{vmid}-cloudinit,media=cdrom"
            continue
        options = dict(p.split("=", 1) for p in value.split(",")[1:] if "=" in p)
        source = options.pop("import-from", None)
        if not _NEW_DISK.match(value):
            continue
        _images(cl, store)
        size = int(float(rest)) * 1024**3
        if source is not None:
            path = cl.volumes.get(source)
            if path is None:
                raise ApiError(500, f"volume '{source}' does not exist")
            imports[key] = path
            size = _virtual_size(path)
        fmt = options.pop("format", None)  # pve-storage's: named by the file, not kept
        if _storage(cl, store).type in _FILE:
            name = f"{vmid}/vm-{vmid}-disk-{disks}.{fmt or 'raw'}"  # raw: its default
        elif fmt not in (None, "raw"):
            raise ApiError(500, f"unsupported format '{fmt}'")
        else:
            name = f"vm-{vmid}-disk-{disks}"
        opts = "".join(f",{k}={v}" for k, v in options.items())
        config[key] = f"{store}:{name}{opts},size={size_text(size)}"
        disks += 1
    if "net0" in config and "=" not in config["net0"].split(",")[0]:
        model, _, rest = config["net0"].partition(",")
        config["net0"] = f"{model}={cl.fresh_mac()}" + (f",{rest}" if rest else "")
    vm = VM(vmid, c.node, {**config, "lock": "create"})
    cl.vms[vmid] = vm  # the config file exists (locked) from the start

    async def finish() -> None:
        for key, path in imports.items():
            await cl.machines.imported(vm, key, path)
        vm.config.pop("lock", None)

    def remove() -> None:
        if cl.vms.get(vmid) is vm:
            del cl.vms[vmid]

    return cl.spawn(
        c.node,
        "qmcreate",
        str(vmid),
        c.user,
        lock_vmid=vmid,
        duration_s=cl.timings.config_s,
        effect=finish,
        on_fail=remove,
        fault=cl.take("create", TASK_FAULTS),
    )


async def template(c: Call) -> Any:
    """`qm template`: refused for a running VM; its disks become base volumes."""
    cl, vm = c.cluster, c.vm()
    if vm.running:
        raise ApiError(500, "you can't convert a VM to template if VM is running")
    locked(vm)

    def convert() -> None:
        if vm.running:
            raise TaskError("you can't convert a VM to template if VM is running")
        for key, value in list(vm.config.items()):
            if _DISK_KEY.fullmatch(key) and "media=cdrom" not in value:
                vm.config[key] = value.replace(f"vm-{vm.vmid}-disk-", f"base-{vm.vmid}-disk-")
        vm.config["template"] = "1"

    return cl.spawn(
        c.node,
        "qmtemplate",
        str(vm.vmid),
        c.user,
        lock_vmid=vm.vmid,
        duration_s=cl.timings.config_s,
        effect=convert,
        fault=cl.take("template", TASK_FAULTS),
    )


def _images(cl: Cluster, store: str) -> None:
    if "images" not in _content(_storage(cl, store)):
        raise ApiError(500, f"storage '{store}' does not support vm images")


def _size(value: str) -> int:
    match = re.search(r"size=(\d+)([KMGT]?)", value)
    units = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}
    return int(match.group(1)) * units[match.group(2)] if match else 0


def _virtual_size(path: Path) -> int:
    """A qcow2's virtual size (its header, bytes 24-31); a raw file's own size."""
    with path.open("rb") as stream:
        head = stream.read(32)
    if head[:4] == b"QFI\xfb":
        return int.from_bytes(head[24:32], "big")
    return path.stat().st_size


# Shared with tests/support/fakepve/downloads.py.
storage_of = _storage
storage_content = _content
