"""The endpoints: which handler answers each (method, schema path) and under which
name faults are injected into it. The reads are in `reads`, the tasks in `mutations`;
what the guests themselves do is `Cluster.machines`' (`machines`, `realvm`)."""

from __future__ import annotations

from tests.support.fakepve.agentcalls import exec_command, exec_status, file_read, file_write
from tests.support.fakepve.call import Call, Handler
from tests.support.fakepve.downloads import download_url
from tests.support.fakepve.mutations import (
    clone,
    config_async,
    config_sync,
    destroy,
    resize,
    start,
    stopper,
)
from tests.support.fakepve.reads import (
    agent_interfaces,
    agent_ping,
    bridges,
    cluster_status,
    cpu_models,
    nextid,
    node_status,
    node_tasks,
    nodes,
    resources,
    storage_list,
    task_log,
    task_status,
    version,
    vm_config,
    vm_status,
)
from tests.support.fakepve.storage import content, create_vm, delete_volume, template, upload

__all__ = ["ENDPOINTS", "Call", "Handler"]

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
    ("POST", "/nodes/{node}/qemu/{vmid}/status/stop"): ("stop", stopper("qmstop", "stop")),
    ("POST", "/nodes/{node}/qemu/{vmid}/status/shutdown"): (
        "shutdown",
        stopper("qmshutdown", "shutdown"),
    ),
    ("DELETE", "/nodes/{node}/qemu/{vmid}"): ("delete", destroy),
    ("GET", "/nodes/{node}/qemu/{vmid}/agent/network-get-interfaces"): ("agent", agent_interfaces),
    ("POST", "/nodes/{node}/qemu/{vmid}/agent/ping"): ("agent_ping", agent_ping),
    ("GET", "/nodes/{node}/qemu/{vmid}/agent/file-read"): ("agent_file_read", file_read),
    ("POST", "/nodes/{node}/qemu/{vmid}/agent/file-write"): ("agent_file_write", file_write),
    ("POST", "/nodes/{node}/qemu/{vmid}/agent/exec"): ("agent_exec", exec_command),
    ("GET", "/nodes/{node}/qemu/{vmid}/agent/exec-status"): ("agent_exec_status", exec_status),
    ("POST", "/nodes/{node}/qemu"): ("create", create_vm),
    ("POST", "/nodes/{node}/qemu/{vmid}/template"): ("template", template),
    ("POST", "/nodes/{node}/storage/{storage}/upload"): ("upload", upload),
    ("POST", "/nodes/{node}/storage/{storage}/download-url"): ("download", download_url),
    ("GET", "/nodes/{node}/storage/{storage}/content"): ("content", content),
    ("DELETE", "/nodes/{node}/storage/{storage}/content/{volume}"): (
        "volume_delete",
        delete_volume,
    ),
    ("GET", "/nodes/{node}/tasks"): ("tasks", node_tasks),
    ("GET", "/nodes/{node}/tasks/{upid}/status"): ("task_status", task_status),
    ("GET", "/nodes/{node}/tasks/{upid}/log"): ("task_log", task_log),
}
