"""The fake's permissions: what `GET /access/permissions` answers for the API token or
user, configurable per test (revoke a privilege) and from the command line.

As in PVE, the most specific ACL path on the way to a path decides its privileges
(an ACL on /vms/100 overrides the one on /), and every ACL here propagates. The fake
answers with the effective set, and enforces it on the guest agent's file and exec
endpoints only (`ENFORCED`, with the privilege model of the server's release:
`agent_privileges`); the other endpoints do not check.
"""

from __future__ import annotations

from typing import Any

from tests.support.fakepve.errors import ApiError

# The privileges of PVE 8's built-in Administrator role that matter to deploybot and a
# few around them (root@pam holds them all on /).
ALL_PRIVILEGES = (
    "Datastore.Allocate",
    "Datastore.AllocateSpace",
    "Datastore.Audit",
    "Pool.Allocate",
    "Pool.Audit",
    "SDN.Audit",
    "SDN.Use",
    "Sys.Audit",
    "Sys.Modify",
    "VM.Allocate",
    "VM.Audit",
    "VM.Clone",
    "VM.Config.CDROM",
    "VM.Config.CPU",
    "VM.Config.Cloudinit",
    "VM.Config.Disk",
    "VM.Config.HWType",
    "VM.Config.Memory",
    "VM.Config.Network",
    "VM.Config.Options",
    "VM.Console",
    "VM.Migrate",
    "VM.Monitor",
    "VM.PowerMgmt",
)
# PVE 9.0 replaced VM.Monitor by these (pve-access-control 922f710, 0706945; qemu-server
# b92a40ce: see supplement.json's `_source`).
GUEST_AGENT_SINCE = (9, 0)
GUEST_AGENT_PRIVILEGES = (
    "VM.GuestAgent.Audit",
    "VM.GuestAgent.FileRead",
    "VM.GuestAgent.FileSystemMgmt",
    "VM.GuestAgent.FileWrite",
    "VM.GuestAgent.Unrestricted",
)
_AGENT = "/nodes/{node}/qemu/{vmid}/agent/"
ENFORCED = frozenset(
    f"{_AGENT}{name}" for name in ("file-read", "file-write", "exec", "exec-status")
)


def privileges_of(release: tuple[int, int]) -> set[str]:
    """Every privilege root@pam holds on / on this release (of those the fake knows)."""
    if release >= GUEST_AGENT_SINCE:
        return (set(ALL_PRIVILEGES) - {"VM.Monitor"}) | set(GUEST_AGENT_PRIVILEGES)
    return set(ALL_PRIVILEGES)


def agent_privileges(check: list[Any], release: tuple[int, int]) -> tuple[str, list[str], bool]:
    """(path template, privileges, any of them will do) of an agent endpoint's schema
    `permissions.check` (["perm", "/vms/{vmid}", [...], "any", 1]) on this release:
    before PVE 9.0, VM.Monitor alone."""
    path = str(check[1])
    if release < GUEST_AGENT_SINCE:
        return path, ["VM.Monitor"], False
    return path, [str(p) for p in check[2]], "any" in check[3:]


class Acl:
    def __init__(self, release: tuple[int, int] = (8, 2)) -> None:
        self.paths: dict[str, set[str]] = {"/": privileges_of(release)}

    def revoke(self, privilege: str, path: str | None = None) -> None:
        """Take `privilege` away on `path`, or everywhere."""
        for where, privileges in self.paths.items():
            if path is None or where == path:
                privileges.discard(privilege)

    def grant(self, path: str, privileges: set[str]) -> None:
        """An ACL on `path` with exactly these privileges (it overrides those above)."""
        self.paths[path] = set(privileges)

    def effective(self, path: str) -> set[str]:
        parts = path.rstrip("/").split("/")
        while parts:
            where = "/".join(parts) or "/"
            if where in self.paths:
                return set(self.paths[where])
            parts.pop()
        return set()

    def answer(self, params: dict[str, str], caller: str) -> dict[str, Any]:
        """The body of GET /access/permissions for `caller` (a token id or a user)."""
        userid = params.get("userid", caller)
        if userid != caller and "Sys.Audit" not in self.effective("/access"):
            raise ApiError(403, "Permission check failed (/access, Sys.Audit)")
        if "path" in params:
            return {params["path"]: dict.fromkeys(sorted(self.effective(params["path"])), 1)}
        return {p: dict.fromkeys(sorted(privs), 1) for p, privs in self.paths.items()}

    def check(self, caller: str, path: str, privileges: list[str], any_of: bool) -> None:
        """PVE::RPCEnvironment's check / check_any: 403 with its message when refused."""
        held = self.effective(path)
        if any_of and not held & set(privileges):
            raise ApiError(403, f"Permission check failed ({path}, {'|'.join(privileges)})")
        for privilege in [] if any_of else privileges:
            if privilege not in held:
                raise ApiError(403, f"Permission check failed ({path}, {privilege})")
