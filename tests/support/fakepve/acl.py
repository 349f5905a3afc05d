"""The fake's permissions: what `GET /access/permissions` answers for the API token or
user, configurable per test (revoke a privilege) and from the command line.

As in PVE, the most specific ACL path on the way to a path decides its privileges
(an ACL on /vms/100 overrides the one on /), and every ACL here propagates. The fake
answers with the effective set; it does not enforce them on the other endpoints.
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


class Acl:
    def __init__(self) -> None:
        self.paths: dict[str, set[str]] = {"/": set(ALL_PRIVILEGES)}

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
