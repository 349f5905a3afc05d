"""The endpoints: what each one answers and which task it starts, with the real
server's refusals (`VM is locked (clone)`, `... is running - destroy failed`, linked
clones refused with `storage`, plain lvm without the clone feature, ...)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote

from tests.fakepve import guest
from tests.fakepve.cluster import GIB, TASK_FAULTS, VM, ApiError, Cluster, Task, TaskError
from tests.fakepve.formats import CPU_MODELS, ssh_keys_problem

_LINKED = frozenset({"zfspool", "lvmthin", "rbd", "btrfs"})
_FILE = frozenset({"dir", "nfs", "cifs", "glusterfs"})
_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": GIB, "T": 1024**4}
_SIZE = re.compile(r"(\+?)(\d+(?:\.\d+)?)([KMGT]?)")
_NOT_CONFIG = frozenset({"node", "vmid", "digest", "delete", "skiplock", "background_delay"})


@dataclass(frozen=True)
class Call:
    cluster: Cluster
    params: dict[str, str]
    path: dict[str, str]
    user: str

    @property
    def node(self) -> str:
        return self.path["node"]

    @property
    def vmid(self) -> int:
        return int(self.path["vmid"])

    def vm(self) -> VM:
        self.cluster.node(self.node)
        return self.cluster.vm(self.node, self.vmid)


Handler = Callable[[Call], Awaitable[Any]]


def _size_bytes(text: str) -> int:
    match = re.search(r"(?:^|,)size=(\d+(?:\.\d+)?)([KMGT]?)", text)
    return int(float(match.group(1)) * _UNITS[match.group(2)]) if match else 0


def _size_text(size: int) -> str:
    for unit in ("T", "G", "M", "K"):
        if size % _UNITS[unit] == 0:
            return f"{size // _UNITS[unit]}{unit}"
    return str(size)


def _locked(vm: VM) -> None:
    """qemu-server's check_lock in the API's early checks: an HTTP 500 at once."""
    if lock := vm.config.get("lock"):
        raise ApiError(500, f"VM is locked ({lock})")


def _task_locked(vm: VM) -> None:
    """The same check_lock inside a task: the task fails with it."""
    if lock := vm.config.get("lock"):
        raise TaskError(f"VM is locked ({lock})")


# --- reads ------------------------------------------------------------------------------


async def version(c: Call) -> Any:
    release = c.cluster.release
    return {"version": f"{release}.4", "release": release, "repoid": "b4dc0ffee1d0"}


async def cluster_status(c: Call) -> Any:
    cl = c.cluster
    nodes = [
        {
            "type": "node",
            "name": n,
            "id": f"node/{n}",
            "online": int(n not in cl.offline),
            "nodeid": i + 1,
            "local": int(i == 0),
        }
        for i, n in enumerate(cl.nodes)
    ]
    if cl.cluster_name is None:
        return nodes
    head = {
        "type": "cluster",
        "name": cl.cluster_name,
        "id": "cluster",
        "nodes": len(nodes),
        "quorate": 1,
        "version": 3,
    }
    return [head, *nodes]


async def nodes(c: Call) -> Any:
    return [
        {
            "node": n,
            "status": "online",
            "type": "node",
            "id": f"node/{n}",
            "maxcpu": 32,
            "maxmem": 128 * GIB,
            "mem": 20 * GIB,
            "cpu": 0.05,
            "uptime": 86400,
            "level": "",
        }
        for n in c.cluster.nodes
    ]


async def node_status(c: Call) -> Any:
    node = c.cluster.node(c.node)
    cpuinfo: dict[str, Any] = {"model": node.cpu_model, "cores": 16, "cpus": 32, "sockets": 1}
    if node.flags is not None:
        cpuinfo["flags"] = " ".join(sorted(node.flags))
    memory = {"total": 128 * GIB, "used": 20 * GIB, "free": 108 * GIB, "available": 100 * GIB}
    return {
        "cpuinfo": cpuinfo,
        "cpu": 0.05,
        "uptime": 86400,
        "pveversion": f"pve-manager/{c.cluster.release}.4/b4dc0ffee1d0",
        "boot-info": {"mode": "efi", "secureboot": 0},
        "current-kernel": {
            "sysname": "Linux",
            "release": "6.8.12-4-pve",
            "machine": "x86_64",
            "version": "#1 SMP PREEMPT_DYNAMIC PMX 6.8.12-4",
        },
        "loadavg": ["0.12", "0.10", "0.08"],
        "memory": memory,
        "rootfs": {"total": 100 * GIB, "used": 10 * GIB, "free": 90 * GIB, "avail": 85 * GIB},
    }


async def cpu_models(c: Call) -> Any:
    node = c.cluster.node(c.node)
    flags = node.flags or frozenset()
    names = sorted(m for m in CPU_MODELS if m != "x86-64-v3" or "avx2" in flags)
    return [{"name": m, "vendor": "default", "custom": 0} for m in names]


async def storage_list(c: Call) -> Any:
    c.cluster.node(c.node)
    wanted = set(filter(None, re.split(r"[,;\s]+", c.params.get("content", ""))))
    answer = []
    for s in c.cluster.storages.values():
        if wanted and not wanted & set(s.content.split(",")):
            continue
        answer.append(
            {
                "storage": s.name,
                "type": s.type,
                "content": s.content,
                "shared": int(s.shared),
                "active": 1,
                "enabled": 1,
                "total": s.total_bytes,
                "used": s.used_bytes,
                "avail": s.total_bytes - s.used_bytes,
            }
        )
    return answer


async def bridges(c: Call) -> Any:
    node = c.cluster.node(c.node)
    return [{"iface": b, "type": "bridge", "active": 1, "autostart": 1} for b in node.bridges]


async def resources(c: Call) -> Any:
    kind = c.params.get("type")
    answer: list[dict[str, Any]] = []
    if kind in (None, "vm"):
        for vm in sorted(c.cluster.vms.values(), key=lambda v: v.vmid):
            if vm.vmid in c.cluster.hidden:
                continue
            item: dict[str, Any] = {
                "id": f"qemu/{vm.vmid}",
                "type": "qemu",
                "vmid": vm.vmid,
                "node": vm.node,
                "name": vm.config.get("name", ""),
                "status": _vm_status(c.cluster, vm),
                "template": int(vm.template),
                "maxmem": int(vm.config.get("memory", "512")) * 1024**2,
                "maxdisk": _size_bytes(vm.config.get("scsi0", "")),
            }
            for key in ("tags", "lock"):
                if key in vm.config:
                    item[key] = vm.config[key]
            answer.append(item)
    if kind in (None, "node"):
        answer += [
            {
                "id": f"node/{n}",
                "type": "node",
                "node": n,
                "status": "offline" if n in c.cluster.offline else "online",
            }
            for n in c.cluster.nodes
        ]
    return answer


def _vm_status(cluster: Cluster, vm: VM) -> str:
    """A VM on a node that is down is listed as PVE lists it: status unknown."""
    if vm.node in cluster.offline:
        return "unknown"
    return "running" if vm.running else "stopped"


async def nextid(c: Call) -> Any:
    cl = c.cluster
    if "vmid" in c.params:
        vmid = int(c.params["vmid"])
        if vmid in cl.vms:
            raise ApiError(
                400, "Parameter verification failed.", {"vmid": f"VM {vmid} already exists"}
            )
    else:
        vmid = next(i for i in range(100, 1_000_000) if i not in cl.vms)
    if cl.take("nextid", ("race",)):
        cl.add_vm(vmid, f"intruder{vmid}")  # another client clones into it right now
    return str(vmid)  # a string, as real servers send it


async def vm_config(c: Call) -> Any:
    vm = c.vm()
    return {**vm.config, "digest": vm.digest()}


async def vm_status(c: Call) -> Any:
    vm = c.vm()
    answer: dict[str, Any] = {
        "vmid": vm.vmid,
        "name": vm.config.get("name", ""),
        "status": "running" if vm.running else "stopped",
        "qmpstatus": "running" if vm.running else "stopped",
        "cpus": int(vm.config.get("cores", "1")),
        "maxmem": int(vm.config.get("memory", "512")) * 1024**2,
        "agent": int(vm.config.get("agent", "0")[:1] == "1"),
        "uptime": 0,
        "ha": {"managed": int(vm.ha_managed)},
    }
    for key in ("lock", "tags"):
        if key in vm.config:
            answer[key] = vm.config[key]
    return answer


def _agent_of(c: Call) -> VM:
    """The VM whose agent answers, with the errors qemu-server gives until it does."""
    vm = c.vm()
    if not vm.running:
        raise ApiError(500, f"VM {vm.vmid} is not running")
    if vm.config.get("agent", "0")[:1] != "1" and "enabled=1" not in vm.config.get("agent", ""):
        raise ApiError(500, "No QEMU guest agent configured")
    if not vm.agent_up:
        raise ApiError(500, "QEMU guest agent is not running")
    return vm


async def agent_interfaces(c: Call) -> Any:
    vm = _agent_of(c)
    return {"result": guest.interfaces(vm.config, vm.vmid, vm.leases)}


async def agent_ping(c: Call) -> Any:
    _agent_of(c)
    return {"result": {}}  # guest-ping returns an empty object


async def task_status(c: Call) -> Any:
    return c.cluster.task(c.path["upid"]).status()


def _listed(task: Task) -> dict[str, Any]:
    item: dict[str, Any] = {
        "upid": task.upid,
        "node": task.node,
        "pid": task.pid,
        "pstart": task.pstart,
        "starttime": task.starttime,
        "type": task.type,
        "id": task.id,
        "user": task.user,
    }
    if task.exitstatus is None:  # PVE's own word for a task of the active list
        item["status"] = "RUNNING"
    else:  # finished: as the archive lists it
        item["status"] = task.exitstatus
        item["endtime"] = task.starttime + max(0, round((task.ended_s or 0) - task.began_s))
    return item


async def node_tasks(c: Call) -> Any:
    """The node's tasks, newest first: `active` the running ones, `archive` the finished
    ones, `all` both; with the filters a client is likely to send."""
    cl = c.cluster
    cl.node(c.node)
    p = c.params
    source = p.get("source", "archive")
    answer = []
    for task in sorted(cl.tasks.values(), key=lambda t: t.began_s, reverse=True):
        running = task.exitstatus is None
        if task.node != c.node or (source == "active" and not running):
            continue
        if source == "archive" and running:
            continue
        if running and task.upid in cl.unlisted:
            continue  # a task the active list has not caught up with yet
        if "typefilter" in p and task.type != p["typefilter"]:
            continue
        if "userfilter" in p and p["userfilter"].lower() not in task.user.lower():
            continue
        if "vmid" in p and task.id != p["vmid"]:
            continue
        if p.get("errors") in ("1", "true") and task.exitstatus in (None, "OK"):
            continue
        if "since" in p and task.starttime < int(p["since"]):
            continue
        if "until" in p and task.starttime > int(p["until"]):
            continue
        answer.append(_listed(task))
    start, limit = int(p.get("start", "0")), int(p.get("limit", "50"))
    return answer[start : start + limit]


async def task_log(c: Call) -> Any:
    task = c.cluster.task(c.path["upid"])
    start, limit = int(c.params.get("start", "0")), int(c.params.get("limit", "50"))
    lines = [{"n": i + 1, "t": t} for i, t in enumerate(task.log)]
    return lines[start : start + limit]


# --- mutations -------------------------------------------------------------------------


async def clone(c: Call) -> Any:
    """Early checks at once (the source's config lock among them: a template being
    backed up cannot be cloned), again in the task, as qemu-server's clone_vm does."""
    cl, src = c.cluster, c.vm()
    _locked(src)
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
    config[key] = (
        f"{dest.name}:vm-{newid}-disk-0,{opts}" if full else f"{volid}/vm-{newid}-disk-0,{opts}"
    )
    config["ide2"] = f"{dest.name}:vm-{newid}-cloudinit,media=cdrom"
    config["net0"] = re.sub(r"=([0-9A-F:]{17})", f"={cl.fresh_mac()}", config.get("net0", ""))
    new = VM(newid, target, config, agent_installed=src.agent_installed)
    cl.vms[newid] = new  # exists (locked) from the start, as the real config file does

    def precheck() -> None:
        _task_locked(src)
        if not full and not linked_ok:
            raise TaskError(f"clone failed: Linked clone feature is not supported for '{volid}'")

    def finish() -> None:
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
            f"transferred 0.0 B of {_size_text(_size_bytes(src.config[key]))} (0.00%)",
        ),
    )


def _config_changes(c: Call, vm: VM) -> Callable[[], None]:
    """Check a config change now (as the API does before forking); apply it later."""
    _locked(vm)
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
    _locked(vm)
    disk = c.params["disk"]
    if disk not in vm.config:
        raise ApiError(500, f"disk '{disk}' does not exist")
    match = _SIZE.fullmatch(c.params["size"])
    assert match is not None  # the schema pattern held
    amount = int(float(match.group(2)) * _UNITS[match.group(3)])
    current = _size_bytes(vm.config[disk])
    new = current + amount if match.group(1) else amount
    if new < current:
        raise ApiError(500, "shrinking disks is not supported")

    def grow() -> None:
        vm.config[disk] = re.sub(r"size=[^,]+", f"size={_size_text(new)}", vm.config[disk])

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

    def boot() -> None:
        vm.running = True
        vm.started_at = asyncio.get_running_loop().time()
        vm.boot = asyncio.create_task(_boot(cl, vm))

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


async def _boot(cl: Cluster, vm: VM) -> None:
    """The guest agent answers some time after start; sshd comes up with it."""
    t = cl.timings
    sshd_s = t.agent_after_s if t.sshd_after_s is None else t.sshd_after_s
    for delay, what in sorted([(t.agent_after_s, "agent"), (sshd_s, "sshd")]):
        await asyncio.sleep(
            max(0.0, delay - (asyncio.get_running_loop().time() - (vm.started_at or 0)))
        )
        if what == "agent":
            vm.agent_up = vm.agent_installed
        else:
            await cl.guest.boot(vm.vmid, vm.config)


def _halt(cl: Cluster, vm: VM) -> Callable[[], Awaitable[None]]:
    async def halt() -> None:
        vm.running = False
        vm.agent_up = False
        vm.started_at = None
        if vm.boot is not None:
            vm.boot.cancel()
        await cl.guest.shutdown(vm.vmid)

    return halt


def _stopper(kind: str, endpoint: str) -> Handler:
    async def stop(c: Call) -> Any:
        cl, vm = c.cluster, c.vm()
        skiplock = c.params.get("skiplock") == "1"

        def precheck() -> None:  # qemu-server's _do_vm_stop, in the task
            if vm.running and not skiplock:
                _task_locked(vm)

        return cl.spawn(
            c.node,
            kind,
            str(vm.vmid),
            c.user,
            lock_vmid=vm.vmid,
            duration_s=cl.timings.stop_s,
            precheck=precheck,
            effect=_halt(cl, vm),
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
            _task_locked(vm)

    def remove() -> None:
        if cl.vms.get(vm.vmid) is vm:
            del cl.vms[vm.vmid]

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
ENDPOINTS: dict[tuple[str, str], tuple[str, Handler]] = {
    ("GET", "/version"): ("version", version),
    ("GET", "/cluster/status"): ("cluster_status", cluster_status),
    ("GET", "/cluster/resources"): ("resources", resources),
    ("GET", "/cluster/nextid"): ("nextid", nextid),
    ("GET", "/nodes"): ("nodes", nodes),
    ("GET", "/nodes/{node}/status"): ("node_status", node_status),
    ("GET", "/nodes/{node}/capabilities/qemu/cpu"): ("cpu_models", cpu_models),
    ("GET", "/nodes/{node}/storage"): ("storage", storage_list),
    ("GET", "/nodes/{node}/network"): ("network", bridges),
    ("GET", "/nodes/{node}/qemu/{vmid}/config"): ("config_get", vm_config),
    ("POST", "/nodes/{node}/qemu/{vmid}/config"): ("config", config_async),
    ("PUT", "/nodes/{node}/qemu/{vmid}/config"): ("config", config_sync),
    ("GET", "/nodes/{node}/qemu/{vmid}/status/current"): ("status", vm_status),
    ("POST", "/nodes/{node}/qemu/{vmid}/clone"): ("clone", clone),
    ("PUT", "/nodes/{node}/qemu/{vmid}/resize"): ("resize", resize),
    ("POST", "/nodes/{node}/qemu/{vmid}/status/start"): ("start", start),
    ("POST", "/nodes/{node}/qemu/{vmid}/status/stop"): ("stop", _stopper("qmstop", "stop")),
    ("POST", "/nodes/{node}/qemu/{vmid}/status/shutdown"): (
        "shutdown",
        _stopper("qmshutdown", "shutdown"),
    ),
    ("DELETE", "/nodes/{node}/qemu/{vmid}"): ("delete", destroy),
    ("GET", "/nodes/{node}/qemu/{vmid}/agent/network-get-interfaces"): ("agent", agent_interfaces),
    ("POST", "/nodes/{node}/qemu/{vmid}/agent/ping"): ("agent_ping", agent_ping),
    ("GET", "/nodes/{node}/tasks"): ("tasks", node_tasks),
    ("GET", "/nodes/{node}/tasks/{upid}/status"): ("task_status", task_status),
    ("GET", "/nodes/{node}/tasks/{upid}/log"): ("task_log", task_log),
}
