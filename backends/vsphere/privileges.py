"""The privileges a deploy needs on vSphere, asked of the AuthorizationManager for this
session (`HasPrivilegeOnEntity`) on the objects a clone uses: the template, the VM
folder, the resource pool, the datastore and the network (`deploybot check`).

On vCenter the clone is CloneVM_Task; on a standalone ESXi host the disk is copied and
a VM created (backends/vsphere/esxi.py), which needs other privileges on the same
objects. The lists follow VMware's "required privileges" of those calls, plus the
reconfigure (guestinfo, NIC), power and destroy of the later steps and rollback.
"""

from __future__ import annotations

from typing import Any

from backends.base import MissingPrivilege
from backends.vsphere.conn import Conn
from backends.vsphere.inventory import Plan

CLONE = "copy the template"
CONFIGURE = "set the identity (guestinfo) and NIC"


def needs(plan: Plan, vcenter: bool) -> list[tuple[str, Any, str, str]]:
    """(where, object, privilege, step) for what the steps do."""
    name = getattr(plan.template_config, "name", "template")
    template = f"template {name}"
    folder = "the VM folder"
    pool = f"resource pool of {plan.placement}"
    store = f"datastore {plan.datastore_name}"
    found: list[tuple[str, Any, str, str]] = []
    if vcenter:
        found += [
            (template, plan.template, "VirtualMachine.Provisioning.Clone", CLONE),
            (folder, plan.folder, "VirtualMachine.Inventory.CreateFromExisting", CLONE),
        ]
    else:
        found += [
            (folder, plan.folder, "VirtualMachine.Inventory.Create", CLONE),
            (store, plan.datastore, "Datastore.FileManagement", CLONE),
        ]
    found += [
        (pool, plan.pool, "Resource.AssignVMToPool", CLONE),
        (store, plan.datastore, "Datastore.AllocateSpace", CLONE),
        (folder, plan.folder, "VirtualMachine.Config.AdvancedConfig", CONFIGURE),
        (folder, plan.folder, "VirtualMachine.Config.EditDevice", CONFIGURE),
        (folder, plan.folder, "VirtualMachine.Interact.PowerOn", "power on"),
        (folder, plan.folder, "VirtualMachine.Interact.PowerOff", "power off on rollback"),
        (folder, plan.folder, "VirtualMachine.Inventory.Delete", "destroy on rollback"),
    ]
    if plan.network is not None:
        where = f"network {plan.network.name}"
        found.append((where, plan.network.obj, "Network.Assign", "attach the NIC"))
    return found


def missing(conn: Conn, plan: Plan) -> list[MissingPrivilege]:
    """Blocking: one HasPrivilegeOnEntity per object, for this session's user."""
    manager = conn.content.authorizationManager
    session = conn.stub.user_session or conn.content.sessionManager.currentSession
    wanted = needs(plan, conn.vcenter)
    by_object: dict[str, tuple[Any, list[tuple[str, str, str]]]] = {}
    for where, obj, privilege, step in wanted:
        by_object.setdefault(obj._moId, (obj, []))[1].append((where, privilege, step))
    lacking = []
    for obj, items in by_object.values():
        ids = [privilege for _where, privilege, _step in items]
        granted = manager.HasPrivilegeOnEntity(entity=obj, sessionId=session.key, privId=ids)
        for (where, privilege, step), ok in zip(items, granted, strict=True):
            if not ok:
                lacking.append(MissingPrivilege(privilege, where, step, str(session.userName)))
    return lacking
