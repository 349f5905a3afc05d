# mypy: disable-error-code="no-untyped-call"
# (pyvmomi is typed, but the constructors of its data objects and pyVim are not)
"""VMware's vcsim for the vSphere tests: built once per session, one fresh server per test.

`tests/support/vsphere/vcsim/main.go` is compiled from Debian's govmomi sources (GOPATH mode,
offline) and started on 127.0.0.1 with TLS, in vCenter (VPX) or ESX mode, with a certificate from
a test CA so that the backend keeps TLS verification on. Where Go or the govmomi
package is missing the tests skip with the reason, except under
DEPLOYBOT_REQUIRE_VCSIM=1 (CI), where that is a failure.

The test also plays two parts the simulator has no one for, each through a pyvmomi
connection of its own: the operator (marking a template, listing the inventory) and the
guests (`GuestAgent`: a guest that boots reads its cloud-init metadata from guestinfo,
configures the NIC whose MAC the metadata names, and reports its address through VMware
Tools, which is vcsim's `SET.guest.ipAddress`).
"""

from __future__ import annotations

import base64
import contextlib
import gzip
import ipaddress
import os
import shutil
import ssl
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import pytest
import trustme
import yaml
from pyVim.connect import Disconnect, SmartConnect
from pyVim.task import WaitForTask
from pyVmomi import vim, vmodl

from backends.vsphere import VSphereBackend, create
from backends.vsphere.config import Config

MAIN_GO = Path(__file__).resolve().parent / "vcsim" / "main.go"
GOPATH_SYSTEM = Path("/usr/share/gocode")
SIMULATOR_SRC = GOPATH_SYSTEM / "src/github.com/vmware/govmomi/simulator"
TEMPLATE = "ubuntu-24.04"
PASSWORD_ENV = "VCSIM_PASSWORD"
PASSWORD = "vcsim-test-Secret-7f3a"  # vcsim takes any; tests check it never shows
# `config.tools.toolsVersion` of a guest running open-vm-tools (guest-managed Tools report
# MAXINT); vcsim's VMs have 0, no Tools.
TOOLS_VERSION = 2147483647


def unavailable(reason: str) -> NoReturn:
    if os.environ.get("DEPLOYBOT_REQUIRE_VCSIM") == "1":
        pytest.fail(f"{reason}; DEPLOYBOT_REQUIRE_VCSIM=1 forbids skipping the vSphere tests")
    pytest.skip(reason)


def build_vcsim(out_dir: Path) -> Path:
    go = shutil.which("go")
    if go is None:
        unavailable("vcsim cannot be built: `go` is not installed (apt-get install golang-go)")
    if not SIMULATOR_SRC.is_dir():
        unavailable(
            f"vcsim cannot be built: {SIMULATOR_SRC} is missing "
            "(apt-get install golang-github-vmware-govmomi-dev)"
        )
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "deploybot-go"
    with_cache = os.access(cache.parent, os.W_OK) or not cache.parent.exists()
    env = {
        **os.environ,
        "GOPATH": f"{out_dir / 'gopath'}:{GOPATH_SYSTEM}",
        "GO111MODULE": "off",
        "GOFLAGS": "",
        "GOPROXY": "off",
        "CGO_ENABLED": "0",
        # A lasting build cache turns the next session's 15 s build into one second.
        "GOCACHE": str(cache if with_cache else out_dir / "gocache"),
    }
    binary = out_dir / "vcsim"
    done = subprocess.run(
        [go, "build", "-o", str(binary), str(MAIN_GO)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if done.returncode != 0:
        pytest.fail(f"building vcsim failed:\n{done.stderr[-3000:]}")
    return binary


@dataclass(frozen=True)
class TlsFiles:
    ca: Path
    cert: Path
    key: Path


@pytest.fixture(scope="session", name="vcsim_binary")
def vcsim_binary_fixture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_vcsim(tmp_path_factory.mktemp("vcsim-build"))


@pytest.fixture(scope="session", name="vcsim_tls")
def vcsim_tls_fixture(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    """A CA of our own and a certificate for 127.0.0.1 (vcsim's built-in one has a
    1024-bit key, which OpenSSL 3 refuses)."""
    return make_tls(tmp_path_factory.mktemp("vcsim-tls"))


def make_tls(where: Path) -> TlsFiles:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    files = TlsFiles(where / "ca.pem", where / "cert.pem", where / "key.pem")
    ca.cert_pem.write_to_path(str(files.ca))
    cert.cert_chain_pems[0].write_to_path(str(files.cert))
    cert.private_key_pem.write_to_path(str(files.key))
    return files


def decode(value: str) -> Any:
    """A guestinfo document as cloud-init reads it: base64, gunzip, YAML."""
    return yaml.safe_load(gzip.decompress(base64.b64decode(value)).decode("utf-8"))


class Vcsim:
    """One running simulator and the test's own (operator) connection to it."""

    def __init__(
        self,
        binary: Path,
        tls: TlsFiles,
        workdir: Path,
        *,
        esx: bool,
        delay: str = "",
        login: tuple[str, str] | None = None,
        vms_per_pool: int = 0,
    ) -> None:
        self.esx = esx
        self.tls = tls
        # `login`: the only user and password vcsim accepts (the operator's too).
        self.login = login or ("operator", "x")
        args = [str(binary), "-cert", str(tls.cert), "-key", str(tls.key), "-delay", delay]
        if login is not None:
            args += ["-username", login[0], "-password", login[1]]
        if vms_per_pool:
            args += ["-vm", str(vms_per_pool)]
        self.log = (workdir / f"vcsim-{'esx' if esx else 'vpx'}.log").open("w")
        self.process = subprocess.Popen(
            [*args, "-esx"] if esx else args, stdout=subprocess.PIPE, stderr=self.log, text=True
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline().split()
        if not line or line[0] != "URL":
            self.stop()
            pytest.fail(f"vcsim did not start; see {self.log.name}")
        self.port = int(line[1].rsplit(":", 1)[1].split("/")[0])
        self.si = self.connect()
        self.content: Any = self.si.content
        self.datacenter: Any = self.content.rootFolder.childEntity[0]

    def connect(self) -> Any:
        context = ssl.create_default_context(cafile=str(self.tls.ca))
        return SmartConnect(
            host="127.0.0.1",
            port=self.port,
            user=self.login[0],
            pwd=self.login[1],
            sslContext=context,
        )

    def config(self, **overrides: Any) -> dict[str, Any]:
        """A `[[backends]]` entry for this simulator."""
        entry: dict[str, Any] = {
            "kind": "vsphere",
            "name": "esxi" if self.esx else "vcenter",
            "host": "127.0.0.1",
            "port": self.port,
            "user": "deploybot@vsphere.local",
            "password_env": PASSWORD_ENV,
            "ca_bundle": str(self.tls.ca),
            "request_timeout_s": 40,
            "cancel_wait_s": 10,
        }
        if not self.esx:
            entry["network"] = "DC0_DVPG0"
        return {**entry, **overrides}

    def backend(self, **overrides: Any) -> VSphereBackend:
        return create(Config.model_validate(self.config(**overrides)), {PASSWORD_ENV: PASSWORD})

    def make_template(self, vm_name: str, name: str, note: str = "") -> Any:
        vm = next(v for v in self.datacenter.vmFolder.childEntity if v.name == vm_name)
        WaitForTask(vm.PowerOffVM_Task())
        WaitForTask(vm.Rename_Task(name))
        if note:
            WaitForTask(vm.ReconfigVM_Task(vim.vm.ConfigSpec(annotation=note)))
        vm.MarkAsTemplate()
        return vm

    def vms(self) -> dict[str, str]:
        """Every VM in the inventory, templates too: instance UUID -> name."""
        view = self.content.viewManager.CreateContainerView(
            self.content.rootFolder, [vim.VirtualMachine], True
        )
        try:
            return {vm.config.instanceUuid: vm.name for vm in view.view}
        finally:
            view.DestroyView()

    def network_names(self) -> list[str]:
        """Every network in the inventory as the operator sees it, uplinks included."""
        view = self.content.viewManager.CreateContainerView(
            self.content.rootFolder, [vim.Network], True
        )
        try:
            return [net.name for net in view.view]
        finally:
            view.DestroyView()

    def vm(self, instance_uuid: str) -> Any:
        return self.content.searchIndex.FindByUuid(None, instance_uuid, True, True)

    def extra(self, vm: Any) -> dict[str, str]:
        return {o.key: o.value for o in vm.config.extraConfig}  # the last value wins

    def datastore_folders(self) -> set[str]:
        """The folders on the datastores: vcsim keeps each datastore in a local directory."""
        view = self.content.viewManager.CreateContainerView(
            self.content.rootFolder, [vim.Datastore], True
        )
        try:
            roots = {Path(ds.summary.url) for ds in view.view}
        finally:
            view.DestroyView()
        return {f"{root.name}/{entry.name}" for root in roots for entry in root.iterdir()}

    def task_history(self) -> list[str]:
        """What the server's recent tasks were (their descriptionId). Only that property
        is read: pyvmomi cannot parse vcsim's full TaskInfo of a disk copy."""
        query = vmodl.query.PropertyCollector
        spec = query.FilterSpec(
            objectSet=[query.ObjectSpec(obj=t) for t in self.content.taskManager.recentTask],
            propSet=[query.PropertySpec(type=vim.Task, pathSet=["info.descriptionId"])],
        )
        found = self.content.propertyCollector.RetrieveContents([spec])
        return [str(o.propSet[0].val) for o in found]

    def set_annotation(self, instance_uuid: str, note: str) -> None:
        """Edit a VM's notes as a person would (deploybot keeps its job tag there)."""
        WaitForTask(self.vm(instance_uuid).ReconfigVM_Task(vim.vm.ConfigSpec(annotation=note)))

    def set_guest_address(self, vm: Any, address: str) -> None:
        option = vim.option.OptionValue(key="SET.guest.ipAddress", value=address)
        WaitForTask(vm.ReconfigVM_Task(vim.vm.ConfigSpec(extraConfig=[option])))

    def build_by_hand(self, name: str, address: str) -> str:
        """A VM someone made without deploybot (no job tag), running, whose Tools report
        `address`: one of vcsim's own VMs, renamed. Returns its instance UUID."""
        view = self.content.viewManager.CreateContainerView(
            self.content.rootFolder, [vim.VirtualMachine], True
        )
        try:
            vm = next(v for v in view.view if v.name.endswith("_VM1") and not v.config.template)
        finally:
            view.DestroyView()
        WaitForTask(vm.Rename_Task(name))
        if vm.runtime.powerState != "poweredOn":
            WaitForTask(vm.PowerOnVM_Task())
        self.set_guest_address(vm, address)
        return str(vm.config.instanceUuid)

    def stop(self) -> None:
        with_si = getattr(self, "si", None)
        if with_si is not None:
            Disconnect(with_si)
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()
        self.log.close()


@dataclass
class Booted:
    name: str
    fqdn: str
    address: str
    mac: str
    metadata: dict[str, Any]
    userdata: dict[str, Any]


@dataclass
class GuestAgent:
    """Plays every guest: on power-on it reads its cloud-init documents from guestinfo
    and reports the static address they give, as VMware Tools would after boot. Like
    cloud-init, it configures only the NIC whose MAC the metadata names: metadata for
    another MAC leaves the guest without its address, which is reported as an error.

    It watches power states through a PropertyCollector of its own (vcsim delivers the
    change), so no test waits by sleeping. `silent` guests never report an address.
    """

    sim: Vcsim
    boot_s: float = 0.0  # how long a guest takes to boot before it reports (benchmarks)
    silent: set[str] = field(default_factory=set)
    booted: dict[str, Booted] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._si = self.sim.connect()
        content = self._si.content
        self._pc = content.propertyCollector.CreatePropertyCollector()
        view = content.viewManager.CreateContainerView(
            content.rootFolder, [vim.VirtualMachine], True
        )
        query = vmodl.query.PropertyCollector
        traverse = query.TraversalSpec(
            name="view", type=vim.view.ContainerView, path="view", skip=False
        )
        self._pc.CreateFilter(
            query.FilterSpec(
                objectSet=[query.ObjectSpec(obj=view, skip=True, selectSet=[traverse])],
                propSet=[
                    query.PropertySpec(type=vim.VirtualMachine, pathSet=["runtime.powerState"])
                ],
            ),
            False,
        )
        self._stopping = False
        self._timers: list[threading.Timer] = []
        self._running: set[str] = set()
        self._thread = threading.Thread(target=self._run, name="guest-agent", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        version = ""
        while not self._stopping:
            try:
                update = self._pc.WaitForUpdatesEx(version, None)
            except vmodl.fault.RequestCanceled:
                return
            except Exception as exc:  # the simulator went away
                if not self._stopping:  # (when stopping, the server may end the poll first)
                    self.errors.append(repr(exc))
                return
            version = update.version
            for obj in (o for f in update.filterSet for o in f.objectSet):
                state = next((c.val for c in obj.changeSet if c.name == "runtime.powerState"), None)
                self._power_changed(obj.obj, state)

    def _power_changed(self, vm: Any, state: str | None) -> None:
        key = vm._moId
        if state != "poweredOn":
            self._running.discard(key)
            return
        if key in self._running:
            return
        self._running.add(key)
        if self.boot_s:
            timer = threading.Timer(self.boot_s, self._boot_reporting, [vm])
            self._timers.append(timer)
            timer.start()
        else:
            self._boot_reporting(vm)

    def _boot_reporting(self, vm: Any) -> None:
        key = vm._moId
        try:
            self._boot(vm)
        except vmodl.fault.ManagedObjectNotFound:
            return  # destroyed while it booted (a rollback)
        except Exception as exc:  # reported by the fixture: a thread cannot fail a test
            if not self._stopping:  # (when stopping, the session may end under it)
                self.errors.append(f"{key}: {exc!r}")

    def _boot(self, vm: Any) -> None:
        extra = {o.key: o.value for o in vm.config.extraConfig}
        if "guestinfo.metadata" not in extra:
            return  # not one of ours: vcsim's own VMs run without cloud-init
        assert extra["guestinfo.metadata.encoding"] == "gzip+base64"
        assert extra["guestinfo.userdata.encoding"] == "gzip+base64"
        metadata = decode(extra["guestinfo.metadata"])
        userdata_text = gzip.decompress(base64.b64decode(extra["guestinfo.userdata"])).decode()
        assert userdata_text.startswith("#cloud-config\n")
        (nic,) = metadata["network"]["config"]
        card = vim.vm.device.VirtualEthernetCard
        macs = [d.macAddress for d in vm.config.hardware.device if isinstance(d, card)]
        if nic["mac_address"] not in [str(m).lower() for m in macs]:
            self.errors.append(
                f"{vm.name}: the metadata configures MAC {nic['mac_address']}, "
                f"the VM's NICs have {macs}: the guest would boot without its address"
            )
            return
        address = str(ipaddress.IPv4Interface(nic["subnets"][0]["address"]).ip)
        fqdn = metadata["local-hostname"]
        name = fqdn.split(".")[0]  # as cloud-init's datasource splits local-hostname
        self.booted[vm.config.instanceUuid] = Booted(
            name, fqdn, address, nic["mac_address"], metadata, yaml.safe_load(userdata_text)
        )
        if name not in self.silent:
            self.sim.set_guest_address(vm, address)

    def stop(self) -> None:
        self._stopping = True
        for timer in self._timers:
            timer.cancel()
        with contextlib.suppress(Exception):  # its session may be gone; the server stops next
            self._pc.CancelWaitForUpdates()

    def join(self) -> None:
        """After the server stopped: the agent's threads end, its connections close."""
        self._thread.join(timeout=10)
        assert not self._thread.is_alive(), "the guest agent did not stop"
        for timer in self._timers:
            timer.join(timeout=10)
        self._si._stub.DropConnections()


@dataclass
class Simulated:
    """What a test gets: the simulator and the guests' stand-in."""

    sim: Vcsim
    guests: GuestAgent


@contextlib.contextmanager
def simulator(
    binary: Path,
    tls: TlsFiles,
    workdir: Path,
    *,
    esx: bool,
    delay: str = "",
    boot_s: float = 0,
    vms_per_pool: int = 0,
) -> Iterator[Simulated]:
    """A fresh simulator with one template and the guest agent; `delay` ("Method=ms,...")
    makes those calls slow; `vms_per_pool` VMs in each resource pool (default 2)."""
    sim = Vcsim(binary, tls, workdir, esx=esx, delay=delay, vms_per_pool=vms_per_pool)
    guests: GuestAgent | None = None
    try:
        first = "ha-host_VM0" if esx else "DC0_H0_VM0"
        sim.make_template(first, TEMPLATE, "deploybot template: Ubuntu 24.04 cloud image")
        guests = GuestAgent(sim, boot_s)
        yield Simulated(sim, guests)
    finally:
        if guests is not None:
            guests.stop()
        sim.stop()
        if guests is not None:
            guests.join()
    assert guests.errors == [], guests.errors


@pytest.fixture(name="vcenter")
def vcenter_fixture(vcsim_binary: Path, vcsim_tls: TlsFiles, tmp_path: Path) -> Iterator[Simulated]:
    with simulator(vcsim_binary, vcsim_tls, tmp_path, esx=False) as simulated:
        yield simulated


@pytest.fixture(name="esxi")
def esxi_fixture(vcsim_binary: Path, vcsim_tls: TlsFiles, tmp_path: Path) -> Iterator[Simulated]:
    with simulator(vcsim_binary, vcsim_tls, tmp_path, esx=True) as simulated:
        yield simulated
