# mypy: disable-error-code="no-untyped-call"
# (pyvmomi is typed, but the constructors of its data objects are not)
"""An OVF import: `OvfManager.CreateImportSpec` -> `ResourcePool.ImportVApp` -> the
`HttpNfcLease` -> an HTTP POST of the stream-optimized VMDK to the lease's device URL
-> `HttpNfcLeaseComplete`. Blocking; runs inside `Session.run`.

The import spec carries the VM's durable identity (the instance UUID `prepare_build`
chose) and its annotation (the job tag, the build mark) from the start, so a VM a crash
leaves half-imported is found, and recognised as ours, like any other. Any failure
aborts the lease; vCenter and ESXi then remove the VM, vcsim (0.24) keeps it, so the
VM is also destroyed here when it is still there.
"""

from __future__ import annotations

import contextlib
import http.client
import logging
import ssl
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pyVmomi import vim, vmodl

from backends.base import PermanentError
from backends.vsphere.inventory import Net
from backends.vsphere.session import Op, fault_text

log = logging.getLogger(__name__)
CHUNK = 1024 * 1024
# A lease expires after its leaseTimeout (5 minutes) without progress: tell it at
# least every this many bytes (and at the end).
PROGRESS_EVERY = 64 * CHUNK
STREAM_VMDK = "application/x-vnd.vmware-streamVmdk"


@dataclass(frozen=True)
class Target:
    """Where the import goes and how the upload reaches the server."""

    pool: Any
    folder: Any
    host: Any | None  # a standalone host (ESXi, or a host outside clusters); else None
    datastore: Any
    network: Net | None
    provisioning: str  # thin, thick, eagerZeroedThick
    server: str  # host[:port] that replaces a device URL's `*`
    ssl_context: ssl.SSLContext


def import_vm(op: Op, target: Target, name: str, descriptor: str, vmdk: Path, config: Any) -> Any:
    """Import the VM `name` from `descriptor` and the disk `vmdk`; `config` (a
    ConfigSpec) is merged into the import spec: instance UUID, annotation, firmware.
    Returns the new VM; on any failure no VM is left."""
    manager = op.conn.content.ovfManager
    params = vim.OvfManager.CreateImportSpecParams(
        entityName=name, diskProvisioning=target.provisioning, locale="US", deploymentOption=""
    )
    if target.network is not None:
        params.networkMapping = [
            vim.OvfManager.NetworkMapping(name=target.network.name, network=target.network.obj)
        ]
    result = manager.CreateImportSpec(descriptor, target.pool, target.datastore, params)
    errors = [_message(e) for e in result.error or []]
    if errors or result.importSpec is None:
        raise PermanentError(f"the OVF descriptor was refused: {'; '.join(errors) or 'no spec'}")
    for warning in result.warning or []:
        log.info("OVF import of %s: %s", name, _message(warning))
    spec = result.importSpec
    for key in ("instanceUuid", "annotation", "firmware"):
        value = getattr(config, key, None)
        if value:
            setattr(spec.configSpec, key, value)
    files = {item.deviceId: item for item in result.fileItem or []}
    lease = target.pool.ImportVApp(spec, target.folder, target.host)
    try:
        info = _ready(op, lease)
        vm = info.entity
        urls = [u for u in info.deviceUrl or [] if u.importKey in files]
        if len(urls) != 1:
            raise PermanentError(f"the import lease offers {len(urls)} disk URLs, not 1")
        _upload(op, lease, target, urls[0].url, vmdk)
        lease.HttpNfcLeaseComplete()
    except BaseException as exc:
        _abort(op, lease, exc)
        raise
    return vm


def _message(fault: Any) -> str:
    text = getattr(fault, "localizedMessage", "") or ""
    inner = getattr(fault, "fault", fault)
    return str(text or (fault_text(inner) if isinstance(inner, vmodl.MethodFault) else inner))


def _ready(op: Op, lease: Any) -> Any:
    """Wait (through the PropertyCollector) for the lease to be ready; its info."""

    def done(p: dict[str, Any]) -> dict[str, Any] | None:
        state = p.get("state")
        return p if state in ("ready", "error", "done") else None

    p = op.watch(lease, vim.HttpNfcLease, ["state", "error"], done)
    if p["state"] != "ready":
        error = p.get("error")
        raise PermanentError(f"the import lease ended before the upload: {_message(error)}")
    return op.conn.props(lease, vim.HttpNfcLease, ["info"])["info"]


def device_url(url: str, server: str) -> urllib.parse.SplitResult:
    """A lease's device URL with its `*` host replaced by the server we talk to."""
    parts = urllib.parse.urlsplit(url)
    if parts.hostname == "*":
        parts = parts._replace(netloc=server)
    if parts.scheme != "https":
        raise PermanentError(f"the import lease offers {url}, not an https URL")
    return parts


def _upload(op: Op, lease: Any, target: Target, url: str, vmdk: Path) -> None:
    """POST the VMDK to `url`, telling the lease how far it got."""
    parts = device_url(url, target.server)
    size = vmdk.stat().st_size
    https = http.client.HTTPSConnection(
        parts.hostname or "", parts.port or 443, context=target.ssl_context, timeout=120
    )
    try:
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        https.putrequest("POST", path)
        https.putheader("Content-Type", STREAM_VMDK)
        https.putheader("Content-Length", str(size))
        https.putheader("Cookie", op.conn.stub.soap.cookie)
        https.endheaders()
        try:
            _send(op, lease, https, vmdk, size)
        except OSError:
            # The server may have answered and closed before taking it all (a full
            # datastore): its answer says more than the broken pipe.
            try:
                answer = https.getresponse()
            except (OSError, http.client.HTTPException):
                answer = None
            if answer is None or answer.status in (200, 201):
                raise
        else:
            answer = https.getresponse()
        body = answer.read(500).decode(errors="replace")
        if answer.status not in (200, 201):
            raise PermanentError(f"the disk upload was refused: {answer.status} {body}".strip())
        lease.HttpNfcLeaseProgress(100)
    finally:
        https.close()


def _send(op: Op, lease: Any, https: http.client.HTTPSConnection, vmdk: Path, size: int) -> None:
    sent = told = 0
    with vmdk.open("rb") as disk:
        while chunk := disk.read(CHUNK):
            op.check()
            https.send(chunk)
            sent += len(chunk)
            if sent - told >= PROGRESS_EVERY:
                lease.HttpNfcLeaseProgress(int(sent * 100 / size))
                told = sent


def _abort(op: Op, lease: Any, exc: BaseException) -> None:
    """Abort the lease and make sure its VM went (vcsim keeps it)."""
    vm = None
    with contextlib.suppress(vmodl.MethodFault, OSError, http.client.HTTPException):
        vm = op.conn.props(lease, vim.HttpNfcLease, ["info"]).get("info")
        vm = getattr(vm, "entity", None)
    fault = vmodl.fault.SystemError(reason=str(exc)[:200] or type(exc).__name__)
    with contextlib.suppress(vmodl.MethodFault, OSError, http.client.HTTPException):
        lease.HttpNfcLeaseAbort(fault)
    if vm is None:
        return
    try:
        # An Op of its own: this clean-up must not be cancelled with the import.
        Op(op.conn, op.grace_s).wait(vm.Destroy_Task())
    except vmodl.fault.ManagedObjectNotFound:
        return  # the server removed it with the lease
    except Exception:
        log.warning("could not remove the VM of an aborted import", exc_info=True)
