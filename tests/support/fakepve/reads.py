"""The read endpoints: versions, nodes, storages, the VM list, configs and status, the
guest agent's answers (from `Cluster.machines`), tasks and their logs."""

from __future__ import annotations

import re
from typing import Any

from tests.support.fakepve.call import Call, size_bytes
from tests.support.fakepve.cluster import GIB, VM, Cluster, Task
from tests.support.fakepve.errors import ApiError
from tests.support.fakepve.formats import CPU_MODELS


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
    """The node's bridges (every `type` filter the client sends is a bridge one)."""
    node = c.cluster.node(c.node)
    answer = []
    for name in node.bridges:
        item: dict[str, Any] = {"iface": name, "type": "bridge", "active": 1, "autostart": 1}
        if name in node.vlan_aware:
            item |= {"bridge_vlan_aware": 1, "bridge_vids": node.vlan_aware[name]}
        answer.append(item)
    return answer


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
                "maxdisk": size_bytes(vm.config.get("scsi0", "")),
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


def agent_of(c: Call) -> VM:
    """The VM whose agent may answer, with the errors qemu-server gives before asking."""
    vm = c.vm()
    if not vm.running:
        raise ApiError(500, f"VM {vm.vmid} is not running")
    if vm.config.get("agent", "0")[:1] != "1" and "enabled=1" not in vm.config.get("agent", ""):
        raise ApiError(500, "No QEMU guest agent configured")
    return vm


async def agent_interfaces(c: Call) -> Any:
    vm = agent_of(c)
    return {"result": await c.cluster.machines.agent(vm, "guest-network-get-interfaces")}


async def agent_ping(c: Call) -> Any:
    vm = agent_of(c)
    return {"result": await c.cluster.machines.agent(vm, "guest-ping")}


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
