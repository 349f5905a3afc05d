"""A guest's cloud-init, offline: run by Debian's own Python 3 with Debian's cloud-init.

tests/test_cloudinit_renderers.py starts it as `/usr/bin/python3 -I cloudinit_guest.py
TARGET`, with the guestinfo keys the vSphere backend wrote in the environment as
`VMX_GUESTINFO_*` variables: the transport cloud-init's VMware datasource itself reads
when `VMX_GUESTINFO` is set. It does what the guest's cloud-init does with them, as far
as that can be done without a guest:

* the VMware datasource reads and decodes the documents (`get_data`);
* the network config is parsed (`parse_net_config_data`) and rendered by each of the
  five Linux renderers into TARGET/<renderer>, with the settings of a distribution
  that uses it; `extract_physdevs` says which NIC cloud-init renames to what at boot;
* the host name and FQDN are what `cc_set_hostname` would set, /etc/hosts is what
  `cc_update_etc_hosts` writes (into TARGET), the user-data is checked against
  cloud-init's schema;
* the host key files `cc_ssh` writes from `ssh_keys` are named from its own table
  (`CONFIG_KEY_TO_FILE`: path and mode), not written: its `ssh_deletekeys` step
  deletes by a fixed glob on the machine's own /etc/ssh. With `--ssh` (second argument)
  cc_ssh runs for real, but only where /etc/ssh is a bind mount of a test's folder (and
  /root, whose authorized_keys it writes): the test runs it in a mount namespace
  (tests/support/mountns.py); the files it leaves in /etc/ssh are in the answer.

It prints one JSON document. Nothing is written outside TARGET: the distributions'
renderer settings hold absolute paths (netplan's would escape the target, since it
joins them with `os.path.join`), so they are made relative, and every file cloud-init
writes is checked to be inside TARGET first (this runs as root in CI). The host's own
network interfaces are never read: cloud-init's sysfs path points at an empty folder.
"""

from __future__ import annotations

import grp
import json
import logging
import os
import pwd
import sys
from pathlib import Path
from typing import Any

import cloudinit.net
from cloudinit import distros, helpers, util, version
from cloudinit.cloud import Cloud
from cloudinit.config import cc_ssh, cc_update_etc_hosts
from cloudinit.config.schema import SchemaValidationError, get_schema, validate_cloudconfig_schema
from cloudinit.net import network_state, renderers
from cloudinit.sources.DataSourceVMware import DataSourceVMware

# Each renderer with the distribution whose settings it is rendered with.
RENDERERS = {
    "netplan": "ubuntu",
    "networkd": "photon",
    "eni": "debian",
    "sysconfig": "rhel",
    "network-manager": "fedora",
}


class Confined:
    """Refuse any write outside `root`: cloud-init writes files through util.write_file,
    makes folders through util.ensure_dir and hands files to a user through
    util.chownbyname; each is checked before it acts. Each renderer gets its own folder
    as the root, so a path that misses it is caught.

    The networkd renderer gives its files to the guest's `systemd-network` user; a
    container without systemd has no such user, and the owner of a file in a temporary
    folder says nothing about its content: there the chown is left out.
    """

    def __init__(self, root: Path, also: tuple[str, ...] = ()) -> None:
        self.root = root
        self.also = also  # paths that are the test's own too (bind mounts, `--ssh`)
        write_file, ensure_dir, chownbyname = util.write_file, util.ensure_dir, util.chownbyname

        def checked_write(filename: str, *args: Any, **kwargs: Any) -> Any:
            self.check(filename)
            return write_file(filename, *args, **kwargs)

        def checked_dir(path: str, *args: Any, **kwargs: Any) -> Any:
            self.check(path)
            return ensure_dir(path, *args, **kwargs)

        def checked_chown(path: str, user: str | None = None, group: str | None = None) -> None:
            self.check(path)
            try:
                pwd.getpwnam(user) if user else None
                grp.getgrnam(group) if group else None
            except KeyError:
                return
            chownbyname(path, user, group)

        util.write_file, util.ensure_dir = checked_write, checked_dir
        util.chownbyname = checked_chown

    def check(self, path: str) -> None:
        root, where = os.path.realpath(self.root), os.path.realpath(path)
        if any(os.path.commonpath([where, mine]) == mine for mine in self.also):
            return
        if os.path.commonpath([where, root]) != root:
            raise RuntimeError(f"cloud-init was about to write {path}, outside {root}")


def renderer_settings(name: str, paths: helpers.Paths) -> dict[str, Any] | None:
    """The settings the distribution gives the renderer, as it renders for a target."""
    distro = distros.fetch(RENDERERS[name])(RENDERERS[name], {}, paths)
    settings: dict[str, Any] | None = distro.renderer_configs.get(name)
    if name == "netplan":
        # The netplan renderer joins its absolute path to the target with os.path.join,
        # which drops the target; and `netplan generate` would act on this machine.
        path = str((settings or {}).get("netplan_path", "/etc/netplan/50-cloud-init.yaml"))
        settings = {**(settings or {}), "netplan_path": path.lstrip("/"), "postcmds": False}
    return settings


def render(
    config: dict[str, Any], target: Path, paths: helpers.Paths, confined: Confined
) -> dict[str, Any]:
    """Each renderer's files, by path inside its own target folder."""
    rendered: dict[str, Any] = {}
    for name in RENDERERS:
        into = target / name
        into.mkdir()
        confined.root = into
        # A fresh state for each: some renderers change the one they are given.
        state = network_state.parse_net_config_data(config)
        module = renderers.NAME_TO_RENDERER[name]
        module.Renderer(renderer_settings(name, paths)).render_network_state(
            state, target=str(into)
        )
        rendered[name] = {
            str(f.relative_to(into)): f.read_text() for f in sorted(into.rglob("*")) if f.is_file()
        }
    return rendered


def host_key_files(userdata: dict[str, Any]) -> dict[str, list[Any]]:
    """path -> [content, mode] of each file cc_ssh's `handle` writes from `ssh_keys`, in
    its order; an entry its table does not know it skips (with a warning)."""
    table = cc_ssh.CONFIG_KEY_TO_FILE
    keys = userdata.get("ssh_keys") or {}
    return {table[k][0]: [value, table[k][1]] for k, value in keys.items() if k in table}


def mount_points() -> set[str]:
    """This process's mount points (a bind mount of a folder on the same file system is
    one, which os.path.ismount cannot tell)."""
    with open("/proc/self/mountinfo", encoding="utf-8") as table:
        return {line.split()[4] for line in table if len(line.split()) > 4}


def run_cc_ssh(userdata: dict[str, Any], cloud: Cloud) -> dict[str, list[Any]]:
    """cc_ssh's `handle` for real, on /etc/ssh and /root that are the test's own folders
    (the caller runs this in a mount namespace where they are bind mounts: see
    tests/support/mountns.py); then every file under /etc/ssh: [content, mode]."""
    if not {"/etc/ssh", "/root"} <= mount_points():
        raise SystemExit("--ssh runs only where /etc/ssh is a test's bind mount")
    cc_ssh.handle("ssh", userdata, cloud, logging.getLogger(), [])
    found: dict[str, list[Any]] = {}
    for path in sorted(Path("/etc/ssh").rglob("*")):
        if path.is_file():
            found[str(path)] = [path.read_text(), path.stat().st_mode & 0o777]
    return found


def main() -> None:
    target = Path(sys.argv[1]).resolve()
    ssh = sys.argv[2:] == ["--ssh"]  # run cc_ssh (only in a mount namespace: see run_cc_ssh)
    confined = Confined(target, ("/etc/ssh", "/root") if ssh else ())
    sysfs = target / "sys-class-net"
    sysfs.mkdir()
    cloudinit.net.SYS_CLASS_NET = f"{sysfs}/"
    paths = helpers.Paths(
        {
            "cloud_dir": str(target / "var/lib/cloud"),
            "run_dir": str(target / "run/cloud-init"),
            "templates_dir": "/etc/cloud/templates/",
        }
    )
    distro = distros.fetch("debian")("debian", {}, paths)
    distro.hosts_fn = str(target / "etc/hosts")
    (target / "etc").mkdir()
    source = DataSourceVMware({}, distro, paths)
    if not source.get_data():
        raise SystemExit("the VMware datasource found no guestinfo in the environment")
    config = source.network_config
    raw = source.get_userdata_raw()
    if not raw.startswith("#cloud-config\n"):
        raise SystemExit("the user-data is not a #cloud-config document")
    userdata = util.load_yaml(raw)
    try:
        validate_cloudconfig_schema(userdata, get_schema(), strict=True, log_details=False)
        schema_error = None
    except SchemaValidationError as exc:
        schema_error = str(exc)
    cloud = Cloud(source, paths, userdata, distro, helpers.Runners(paths))
    hostname, fqdn, _default = util.get_hostname_fqdn(userdata, cloud)
    cc_update_etc_hosts.handle("update_etc_hosts", userdata, cloud, logging.getLogger(), [])
    hosts = Path(distro.hosts_fn)
    result = {
        "version": version.version_string(),
        "network_config": config,
        "physdevs": cloudinit.net.extract_physdevs(config),
        "rendered": render(config, target, paths, confined),
        "datasource_hostname": source.get_hostname().hostname,
        "datasource_fqdn": source.get_hostname(fqdn=True).hostname,
        "hostname": hostname,
        "fqdn": fqdn,
        "etc_hosts": hosts.read_text() if hosts.exists() else None,
        "userdata": userdata,
        "schema_error": schema_error,
        "ssh_key_files": host_key_files(userdata),
    }
    if ssh:
        result["etc_ssh"] = run_cc_ssh(userdata, cloud)
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
