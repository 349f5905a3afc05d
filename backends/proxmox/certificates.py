"""A host certificate put into a running guest through the QEMU guest agent
(`backends.abilities.InstallsHostCertificates`): `POST agent/file-write` of the certificate
next to its key, then `POST agent/exec` of a short `sh -c` (`SCRIPT`) that makes sshd
present it and reloads sshd, then `GET agent/exec-status` until it exited.

The privileges depend on the release (qemu-server's Agent.pm, the fake's supplement.json):
`VM.Monitor` for both before PVE 9; from 9.0 file-write needs `VM.GuestAgent.FileWrite`
(or `VM.GuestAgent.Unrestricted`) and exec and exec-status `VM.GuestAgent.Unrestricted`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

from backends.base import PermanentError, RetryableError
from backends.proxmox.api import PveApi
from backends.proxmox.apierrors import AgentNotRunning, Forbidden
from backends.proxmox.hostkeys import GUEST_AGENT_PRIVILEGES_SINCE, UNRESTRICTED

# A certificate's algorithm -> the host key type in cloud-init's and sshd's file names.
KEY_TYPES = {
    "ssh-ed25519-cert-v01@openssh.com": "ed25519",
    "ecdsa-sha2-nistp256-cert-v01@openssh.com": "ecdsa",
    "ecdsa-sha2-nistp384-cert-v01@openssh.com": "ecdsa",
    "ecdsa-sha2-nistp521-cert-v01@openssh.com": "ecdsa",
    "rsa-sha2-512-cert-v01@openssh.com": "rsa",
    "rsa-sha2-256-cert-v01@openssh.com": "rsa",
    "ssh-rsa-cert-v01@openssh.com": "rsa",
}
# Where the line goes when sshd_config includes its drop-in folder (Debian 12, Ubuntu
# 22.04+, RHEL 9: `Include /etc/ssh/sshd_config.d/*.conf`, read before the rest).
DROP_IN = "/etc/ssh/sshd_config.d/50-deploybot-host-certificate.conf"
# $1: the certificate's path. Adds `HostCertificate $1` once (sshd takes several): in the
# drop-in when sshd_config includes sshd_config.d before its first `Match` (a line after a
# Match belongs to that block, where sshd rejects HostCertificate), else into sshd_config
# above its first Match (at the end when it has none). Then `sshd -t`: when sshd rejects the
# configuration, the file is put back as it was and the script fails with sshd's words (a
# reload, or a SIGHUP, with a configuration sshd rejects stops sshd). Then reloads sshd: with
# systemctl, its unit (ssh on Debian, sshd elsewhere; try-reload-or-restart is a no-op for a
# socket-activated sshd that is not running, which reads its config per start) and a failed
# reload is a failure; only without systemctl a SIGHUP to the listener in /run/sshd.pid.
SCRIPT = f"""set -eu
line="HostCertificate $1"
conf=/etc/ssh/sshd_config
[ -f "$conf" ] || {{ echo "$conf is missing: is openssh-server installed?" >&2; exit 2; }}
sshd=$(command -v sshd || echo /usr/sbin/sshd)
[ -x "$sshd" ] || {{ echo "found no sshd (not on PATH, no /usr/sbin/sshd)" >&2; exit 2; }}
target=$conf
if sed -n '/^[[:space:]]*[Mm][Aa][Tt][Cc][Hh][[:space:]]/q;p' "$conf" |
   grep -Eqi '^[[:space:]]*Include[[:space:]]+/etc/ssh/sshd_config\\.d/'; then
  target={DROP_IN}
  mkdir -p /etc/ssh/sshd_config.d
fi
was="$target.deploybot-was"  # the file before the line, put back when sshd rejects it
rm -f "$was"
added=
if ! grep -qxF "$line" "$target" 2>/dev/null; then
  [ ! -f "$target" ] || cp -p "$target" "$was"
  if [ "$target" = "$conf" ] && grep -Eqi '^[[:space:]]*Match[[:space:]]' "$conf"; then
    awk -v line="$line" '!done && tolower($0) ~ /^[ \\t]*match[ \\t]/ {{print line; done=1}} 1' \\
      "$was" > "$conf"
  else
    printf '%s\\n' "$line" >> "$target"
  fi
  added=yes
  echo "added $line to $target"
fi
if ! checked=$("$sshd" -t 2>&1); then
  if [ -z "$added" ]; then :; elif [ -f "$was" ]; then mv -f "$was" "$target"
  else rm -f "$target"; fi
  echo "sshd -t rejects the configuration (sshd not reloaded, $target put back):" \\
    "$checked" >&2
  exit 4
fi
rm -f "$was"
if command -v systemctl >/dev/null 2>&1; then
  failed=
  for unit in ssh.service sshd.service; do
    if said=$(systemctl try-reload-or-restart "$unit" 2>&1); then
      echo "reloaded $unit"; exit 0
    fi
    failed="$failed $unit: $said;"
  done
  echo "systemctl could not reload sshd:$failed" >&2
  exit 3
fi
if [ -s /run/sshd.pid ] && kill -HUP "$(cat /run/sshd.pid)"; then
  echo "sent SIGHUP to sshd"; exit 0
fi
echo "found no way to reload sshd (no systemctl, no /run/sshd.pid)" >&2
exit 3
"""
POLL_S = (0.2, 0.5, 1.0, 2.0)  # exec-status asked after these waits, then every 2 s
EXEC_TIMEOUT_S = 60.0


def key_type(certificate: str) -> str:
    """The host key type a certificate line certifies; PermanentError for anything else."""
    parts = certificate.split()
    if len(parts) < 2 or "\n" in certificate.strip() or parts[0] not in KEY_TYPES:
        raise PermanentError(
            "the host certificate to install is not one OpenSSH host certificate line; "
            "this is a fault in deploybot: report it"
        )
    return KEY_TYPES[parts[0]]


def certificate_path(certificate: str) -> str:
    return f"/etc/ssh/ssh_host_{key_type(certificate)}_key-cert.pub"


def write_privilege(release: tuple[int, int]) -> str:
    """The privilege the agent's file-write needs on /vms/<id> on this release."""
    return "VM.GuestAgent.FileWrite" if release >= GUEST_AGENT_PRIVILEGES_SINCE else "VM.Monitor"


def exec_privilege(release: tuple[int, int]) -> str:
    """The privilege the agent's exec and exec-status need on /vms/<id>."""
    return UNRESTRICTED if release >= GUEST_AGENT_PRIVILEGES_SINCE else "VM.Monitor"


async def install(
    api: PveApi, node: str, vm_id: str, certificate: str, release: tuple[int, int], account: str
) -> str:
    """Write, configure, reload (see the module doc); a note for the job's step."""
    path = certificate_path(certificate)
    base = f"nodes/{node}/qemu/{vm_id}/agent"
    line = " ".join(certificate.split()[:2]) + "\n"  # no comment: it is public anyway
    refused = (vm_id, release, account)
    what = f"writing {path} in VM {vm_id} through its guest agent"
    await _agent(api.post(f"{base}/file-write", what, file=path, content=line), *refused, "write")
    what = f"running a command in VM {vm_id} through its guest agent"
    command = ["/bin/sh", "-c", SCRIPT, "deploybot-certify", path]
    started = await _agent(api.post(f"{base}/exec", what, command=command), *refused, "exec")
    pid = started.get("pid") if isinstance(started, dict) else None
    if pid is None:
        raise PermanentError(f"VM {vm_id}: the guest agent started no process ({started!r})")
    status = await _finished(api, base, vm_id, int(pid), refused)
    code = status.get("exitcode")
    output = _output(status)
    if not status.get("exited") or code != 0:
        how = f"exit code {code}" if code is not None else f"signal {status.get('signal')}"
        raise PermanentError(
            f"VM {vm_id}: installing its host certificate failed in the guest ({how}): "
            f"{output or 'no output'}; the new VM is not kept: fix its template (its "
            "openssh-server and /etc/ssh/sshd_config, as the output says), or deploy "
            "without a host CA (remove host_ca_env from [ssh])",
            vm_id=vm_id,
        )
    return f"host certificate in {path}, sshd reloaded ({output})"


async def _finished(
    api: PveApi, base: str, vm_id: str, pid: int, refused: tuple[str, tuple[int, int], str]
) -> dict[str, Any]:
    """exec-status until the process exited, for up to EXEC_TIMEOUT_S."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + EXEC_TIMEOUT_S
    what = f"status of the command in VM {vm_id} (its guest agent)"
    waits = iter(POLL_S)
    while loop.time() < deadline:
        await asyncio.sleep(next(waits, POLL_S[-1]))
        status = await _agent(api.get(f"{base}/exec-status", what, pid=pid), *refused, "exec")
        if isinstance(status, dict) and status.get("exited"):
            return status
    raise RetryableError(
        f"VM {vm_id}: the command installing its host certificate still runs after "
        f"{EXEC_TIMEOUT_S:.0f} s (pid {pid} in the guest; is sshd's reload hanging?)",
        vm_id=vm_id,
    )


async def _agent(
    call: Awaitable[Any], vm_id: str, release: tuple[int, int], account: str, action: str
) -> Any:
    """One agent request, its refusals in deploybot's words."""
    try:
        return await call
    except AgentNotRunning as exc:
        raise RetryableError(
            f"VM {vm_id}: its guest agent is not running (yet), so its host certificate "
            f"cannot be installed through it ({exc.message})",
            vm_id=vm_id,
        ) from None
    except Forbidden as exc:
        raise Forbidden(
            _refused(vm_id, release, account, action, exc.message), vm_id=vm_id
        ) from None


def _refused(vm_id: str, release: tuple[int, int], account: str, action: str, detail: str) -> str:
    new = release >= GUEST_AGENT_PRIVILEGES_SINCE
    if action == "write":
        privilege = write_privilege(release) + (f" (or {UNRESTRICTED})" if new else "")
        doing = "write files through the QEMU guest agent (file-write)"
    else:
        privilege = exec_privilege(release)
        doing = "run commands through the QEMU guest agent (exec)"
    return (
        f"VM {vm_id}: {account} may not {doing}, which deploybot needs to install the "
        f"new VM's SSH host certificate: grant {privilege} on /vms (PVE {release[0]}."
        f"{release[1]}), then deploy again; `deploybot check` lists what is missing ({detail})"
    )


def _output(status: dict[str, Any]) -> str:
    """The command's stderr and stdout (what went wrong first), on one line, cut to a
    readable length."""
    text = " ".join(
        str(status.get(stream, "")).strip() for stream in ("err-data", "out-data")
    ).strip()
    text = " / ".join(line for line in text.splitlines() if line.strip())
    return text if len(text) <= 400 else text[:397] + "..."
