"""Proxmox VE: clone a template, give the clone its identity through Proxmox's own
cloud-init fields, start it, read its address from the QEMU guest agent, roll back.

The pieces: `config` (the config entry, OS profiles, credentials),
`api` (requests over `http`'s aiohttp transport, auth, error mapping, the task waiter),
`inventory` (templates, storages, nodes, what a clone implies),
`vmconfig` (reading and writing config values), `identity` (the config change that
gives a clone its identity), `locks` (running tasks, and waiting
out the locks in their way), `cloning` (the new VM's id, and cloning into it only),
`pacing`, `taskwatch` and `agent` (when to look whether a wait is over) and `rollback`
(stop and destroy until done). This module holds the deploy moves and their safety
rules:

* Nothing touches a VM before its clone task ended (so never `VM is locked (clone)`),
  and every change, stop or destroy first reads the VM's config and checks the job's
  tag: in `tags`, or in the description the clone wrote (tags come only afterwards).
* The vmid is chosen before anything exists (`prepare_clone`) and reserved in this
  process, so concurrent deploys never pick the same one; a clone that finds it taken
  by another client raises IdTaken and the pipeline picks a new id (`cloning`).
* The CPU model comes from the template's OS profile; a node that cannot provide it is
  refused before cloning, rather than booting a guest that panics.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from backends.abilities import StepTime
from backends.base import (
    AddressUse,
    CloneMode,
    CloneSpec,
    Identity,
    MissingPrivilege,
    Network,
    NotOurVM,
    PermanentError,
    Placement,
    Segment,
    Storage,
    Template,
    VMInfo,
    VMNotFound,
    VMRef,
)
from backends.building import BuildPlan, BuildTarget, TemplateVersion
from backends.config import BackendConfig
from backends.proxmox import certificates, hostkeys, privileges, rollback
from backends.proxmox.addresses import AddressSweep
from backends.proxmox.agent import AgentWaits
from backends.proxmox.api import PveApi
from backends.proxmox.apierrors import TaskFailed
from backends.proxmox.building import TemplateBuilds
from backends.proxmox.cloning import Cloning
from backends.proxmox.config import Config, credentials
from backends.proxmox.identity import identity_fields
from backends.proxmox.inventory import LINKED_TYPES, Inventory, NoSuchTemplate
from backends.proxmox.locks import TaskRunner
from backends.proxmox.pacing import STEP_OPERATIONS, Pace, Pacing, step_key
from backends.proxmox.segments import Bridges
from backends.proxmox.vmconfig import (
    DISK_MARK,
    GIB,
    boot_disk,
    has_mark,
    mark_field,
    nic_with,
    owned,
    size_text,
    tags_of,
    vm_info,
)
from backends.sshcheck import SshCheck

log = logging.getLogger(__name__)


def create(
    config: BackendConfig, environ: Mapping[str, str], *, pacing: Pacing | None = None
) -> ProxmoxBackend:
    """The backend for a `kind = "proxmox"` entry; connects lazily, on the first call.
    `pacing`: the expected durations to start from (one shared by successive backends
    of a long-running process keeps what they learned)."""
    assert isinstance(config, Config)
    creds = credentials(config, environ)
    if not config.verify_tls:
        log.warning(
            "%s: TLS verification is OFF for %s:%s (verify_tls = false): anyone on the way "
            "can read and change what deploybot sends",
            config.name,
            config.host,
            config.port,
        )
    auth = f"token {config.user}!{config.token_id}" if creds.uses_token else f"ticket {config.user}"
    log.info("%s: Proxmox VE at %s:%s, %s", config.name, config.host, config.port, auth)
    return ProxmoxBackend(config, PveApi(config.name, config.api_settings(), creds), pacing)


class ProxmoxBackend:
    image_platform: str | None = "proxmox"  # bot/images prepares a NoCloud-ready qcow2
    host_keys_through = "the QEMU guest agent"  # ReadsHostKeys: see `host_keys`
    certificates_through = "the QEMU guest agent"  # InstallsHostCertificates

    def __init__(self, config: Config, api: PveApi, pacing: Pacing | None = None) -> None:
        self.name = config.name
        self.default_network = config.bridge
        self.endpoint = (config.host, config.port)
        self.default_storage = config.storage
        self.config = config
        self.api = api
        self._ssh = SshCheck(config.ssh_jump)
        self.inventory = Inventory(config, api)
        self.bridges = Bridges(api, config.discovery_cache_s)
        self.tasks = TaskRunner(config, api, self.inventory)
        # (vm id, job) -> a growth's absolute target, for a VM without the disk mark.
        self._resize_targets: dict[tuple[str, str], int] = {}
        self.pacing = pacing or Pacing()
        self.pacing.guess(config.expect_s)
        self.cloning = Cloning(config, api, self.inventory, self.tasks, self.pacing)
        self.builds = TemplateBuilds(config, api, self.inventory, self.tasks, self.cloning)
        polling = api.settings.polling
        agent_polling = replace(
            polling, initial_s=max(polling.initial_s, config.agent_poll_initial_s)
        )
        self.agent = AgentWaits(api, self.pacing, agent_polling, config.agent_poll_window_s)
        parallel = min(config.addresses_parallel, config.max_parallel_requests)
        self.address_sweep = AddressSweep(
            api, self.inventory, cache_s=config.addresses_cache_s, parallel=parallel
        )

    def remember_steps(self, history: list[StepTime]) -> None:
        """Expected durations from the job history (newest first), for the waits this
        process has not timed itself yet (see `pacing`)."""
        grouped: dict[tuple[str, str], list[float]] = {}
        for step in history:
            if operation := STEP_OPERATIONS.get(step.step):
                key = step_key(step.step, step.template, step.storage)
                grouped.setdefault((operation, key), []).append(step.duration_s)
        for (operation, key), durations in grouped.items():
            self.pacing.remember(operation, key, durations)

    # --- discovery --------------------------------------------------------------------

    async def templates(self) -> list[Template]:
        found = (await self.inventory.templates()).values()
        return [t.public(self.inventory.profile(t.family).user) for t in found]

    async def template(self, name: str) -> Template | None:
        """One template by name, reading only its config (`bot.requests.admission` asks this)."""
        try:
            found = await self.inventory.template(name)
        except NoSuchTemplate:
            return None
        return found.public(self.inventory.profile(found.family).user)

    async def missing_privileges(
        self, template: str, segments: Sequence[Segment] = (), *, certificates: bool = False
    ) -> list[MissingPrivilege]:
        """What a deploy of `template` with NICs on `segments` needs and this token or
        user lacks (with `certificates`, installing host certificates too);
        `NoSuchTemplate` when there is no such template (the paths asked depend on it)."""
        found = await self.inventory.template(template)
        release = await self.inventory.release()
        return await privileges.missing(
            self.api, self.config, found, release, segments, certificates=certificates
        )

    async def storages(self, placement: str | None = None) -> list[Storage]:
        node = placement or await self.inventory.default_node()
        return [
            Storage(s.name, node, s.total_bytes, s.free_bytes, s.type in LINKED_TYPES)
            for s in await self.inventory.storages(node)
        ]

    async def networks(self, placement: str | None = None) -> list[Network]:
        node = placement or await self.inventory.default_node()
        items = await self.api.get(f"nodes/{node}/network", "bridge list", type="any_bridge")
        return [Network(str(i["iface"]), node) for i in items]

    async def placements(self) -> list[Placement]:
        return [Placement(n) for n in await self.inventory.online_nodes()]

    async def clone_mode(self, spec: CloneSpec) -> CloneMode:
        template = await self.inventory.template(spec.template)
        node = self.inventory.target_node(spec, template)
        mode, _storage = await self.inventory.clone_mode(spec, template, node)
        return mode

    # --- finding VMs ------------------------------------------------------------------

    async def find_vm(self, ref: VMRef) -> VMInfo | None:
        """The VM behind a ref; None when gone, or when its id now names another VM."""
        try:
            node, config = await self._owned(ref)
        except (VMNotFound, NotOurVM):
            return None
        status = await self.api.get(f"nodes/{node}/qemu/{ref.vm_id}/status/current", "VM status")
        running = status.get("status") == "running"
        name, lock = (
            str(config.get("name", "")),
            str(config["lock"]) if config.get("lock") else None,
        )
        return VMInfo(ref.vm_id, name, running, tags_of(config), node, lock)

    async def find_by_name(self, name: str) -> list[VMInfo]:
        vms = await self.inventory.vms()  # the last look before a clone: asked afresh
        return [vm_info(i) for i in vms if i.get("name") == name and not i.get("template")]

    async def find_tagged(self) -> list[VMInfo]:
        """Tagged VMs, plus stopped ones whose description carries a job mark: a clone
        whose identity (and tags) never came, the orphan a crash leaves behind."""
        vms = [vm_info(i) for i in await self.inventory.vms() if not i.get("template")]
        tagged = [v for v in vms if has_mark(v.tags)]
        bare = [v for v in vms if not has_mark(v.tags) and not v.running]
        configs = await asyncio.gather(
            *(self.inventory.vm_config(str(v.placement), v.vm_id) for v in bare)
        )
        for vm, config in zip(bare, configs, strict=True):
            if config is not None and has_mark(tags_of(config)):
                tagged.append(replace(vm, tags=tags_of(config)))
        return tagged

    async def addresses_in_use(self, ours: str | None = None) -> list[AddressUse]:
        """See `Backend.addresses_in_use` and `addresses` (a request or two per VM not
        built by installation `ours`)."""
        return await self.address_sweep.addresses(ours)

    async def macs_in_use(self) -> dict[str, str]:
        """`KnowsMacs`: every VM's `netN` MACs, reusing the configs the address sweep read
        (`AddressSweep.macs`): a config read per VM it left out, none per VM it read."""
        return await self.address_sweep.macs()

    async def _locate(self, ref: VMRef) -> str:
        """The node a ref names, once it is clear the ref was made on this cluster."""
        node, _, cluster = (ref.placement or "").partition("@")
        ours = await self.inventory.cluster_name() if cluster else None
        if cluster and cluster != ours:
            raise PermanentError(
                f"VM {ref.vm_id} was built on cluster {cluster}, but {self.name} now talks "
                f"to {ours or 'a standalone node'}: not touching it"
            )
        return node or await self.inventory.default_node()

    async def _owned(self, ref: VMRef) -> tuple[str, dict[str, Any]]:
        """Node and config of the ref's VM, refusing one without the job's tag."""
        node = await self._locate(ref)
        config = await self.inventory.vm_config(node, ref.vm_id)
        if config is None:  # migrated to another node since?
            moved = [i for i in await self.inventory.vms() if str(i.get("vmid")) == ref.vm_id]
            if moved and str(moved[0]["node"]) != node:
                node = str(moved[0]["node"])
                config = await self.inventory.vm_config(node, ref.vm_id)
        return node, owned(config, ref, node, self.name)

    # --- clone ------------------------------------------------------------------------

    async def prepare_clone(self, spec: CloneSpec) -> VMRef:
        template = await self.inventory.template(spec.template)
        node = self.inventory.target_node(spec, template)
        # The checks do not depend on each other: asked together (each is a round
        # trip before the clone can start), then judged in order. An id is asked for
        # only once they pass.
        nodes, mode, baseline, cluster, segment = await asyncio.gather(
            self.inventory.online_nodes(),
            self.inventory.clone_mode(spec, template, node),
            self.inventory.check_baseline(template, node),
            self.inventory.cluster_name(),
            self._segment_fits(spec, node),
            return_exceptions=True,
        )
        if isinstance(nodes, list) and node not in nodes:
            raise PermanentError(
                f"{node!r} is not an online node of {self.name} (have: {', '.join(nodes)})"
            )
        for found in (nodes, mode, baseline, cluster, segment):
            if isinstance(found, BaseException):
                raise found
        vmid = await self.cloning.free_vmid()
        placement = f"{node}@{cluster}" if cluster else node
        return VMRef(str(vmid), spec.job_id, placement, spec.installation)

    async def _segment_fits(self, spec: CloneSpec, node: str) -> None:
        """Each NIC's bridge is on the node and carries its VLAN (`segments`); asked only
        of NICs whose subnet has a segment (else the template's bridge stays). The
        node's bridges are read once for all of them (`Bridges` keeps the read)."""
        more = (n.segment for n in spec.more_nics)
        for segment in (spec.segment, *more):
            if segment is not None:
                await self.bridges.check(segment, node, self.name)

    async def segment_problems(self, segment: Segment) -> list[str]:
        """`ChecksSegments`: the segment on every online node."""
        problems = []
        for node in await self.inventory.online_nodes():
            try:
                await self.bridges.check(segment, node, self.name)
            except PermanentError as exc:
                problems.append(exc.message)
        return problems

    async def clone(self, spec: CloneSpec, ref: VMRef) -> str | None:
        return await self.cloning.clone(spec, ref, await self._locate(ref))

    # --- identity, disk, power ----------------------------------------------------------

    async def apply_identity(self, ref: VMRef, identity: Identity) -> str | None:
        """One config change: cloud-init fields, size, CPU model, tags and description."""
        node, config = await self._owned(ref)
        family = mark_field(config, "os") or "unknown"
        fields = identity_fields(
            config,
            identity,
            ref.tag,
            cpu=self.inventory.cpu_for(family),
            nic=nic_with(
                config.get("net0"),
                self.inventory.profile(family).nic_model,
                identity.network or self.config.bridge,
                identity.segment,
                identity.mac,
            ),
            release=await self.inventory.release(),
        )
        what = f"identity of VM {ref.vm_id}"
        path = f"nodes/{node}/qemu/{ref.vm_id}/config"
        start = functools.partial(self.api.post, path, what, **fields.params)
        pace = Pace(self.pacing, "config", mark_field(config, "template") or "")
        await self.tasks.run(what, node, ref.vm_id, start, pace=pace)
        return fields.note

    async def grow_disk(self, ref: VMRef, grow_gib: int) -> str | None:
        if grow_gib < 0:
            raise PermanentError("shrinking disks is not supported")
        if grow_gib == 0:
            return None
        node, config = await self._owned(ref)
        disk = boot_disk(config)
        # An absolute target: a retry after a lost answer, or a job resumed after a
        # restart, must not grow the disk twice. From the size the identity change
        # marked (durable); a VM without that mark: fixed by this process's first try.
        cloned = mark_field(config, DISK_MARK)
        if cloned and cloned.isdigit():
            target = int(cloned) + grow_gib * GIB
        else:
            first = disk.size_bytes + grow_gib * GIB
            target = self._resize_targets.setdefault((ref.vm_id, ref.job_id), first)
        if disk.size_bytes < target:
            what = f"growing {disk.key} of VM {ref.vm_id} to {size_text(target)}"
            path = f"nodes/{node}/qemu/{ref.vm_id}/resize"
            size = size_text(target)
            start = functools.partial(self.api.put, path, what, disk=disk.key, size=size)
            pace = Pace(self.pacing, "resize", mark_field(config, "template") or "")
            await self.tasks.run(what, node, ref.vm_id, start, pace=pace)
        self._resize_targets.pop((ref.vm_id, ref.job_id), None)
        return None

    async def power_on(self, ref: VMRef) -> str | None:
        node, config = await self._owned(ref)
        template = mark_field(config, "template") or ""
        what = f"start of VM {ref.vm_id}"
        path = f"nodes/{node}/qemu/{ref.vm_id}/status/start"
        pace = Pace(self.pacing, "start", template)
        try:
            await self.tasks.run(
                what, node, ref.vm_id, functools.partial(self.api.post, path, what), pace=pace
            )
        except TaskFailed as exc:
            if "already running" not in exc.exitstatus:  # a retry after a lost answer
                raise
            if ref.vm_id in self.agent.watches:
                return None  # the boot began with the lost answer: keep its clock
        # A new boot: the agent's clock starts when the start task ended (Pace.ended_at).
        self.agent.booted(ref.vm_id, node, template, pace.ended_at())
        return None

    # --- address and SSH ----------------------------------------------------------------

    async def wait_for_address(
        self, ref: VMRef, expected: ipaddress.IPv4Address | None
    ) -> ipaddress.IPv4Address:
        """Ask the guest agent (see `agent`) for up to `agent_poll_window_s`, then
        raise a RetryableError saying whether it never answered or answered without a
        usable address; the pipeline calls again until its own timeout."""
        watch = self.agent.watches.get(ref.vm_id)
        if watch is not None:  # started by power_on, which checked the tag: only reads follow
            return await self.agent.address(watch.node, ref.vm_id, watch.template, expected)
        node, config = await self._owned(ref)
        template = mark_field(config, "template") or ""
        return await self.agent.address(node, ref.vm_id, template, expected)

    async def host_keys(self, ref: VMRef) -> list[str]:
        """The guest's SSH host keys read through its agent (`hostkeys`): what the SSH
        check requires the address to present (`ReadsHostKeys`)."""
        node, _config = await self._owned(ref)
        release = await self.inventory.release()
        return await hostkeys.read(self.api, node, ref.vm_id, release, privileges.who(self.config))

    async def install_host_certificate(self, ref: VMRef, certificate: str) -> str | None:
        """The certificate written next to its key and sshd reloaded, through the guest
        agent's file-write and exec (`certificates`; `InstallsHostCertificates`)."""
        node, _config = await self._owned(ref)
        release = await self.inventory.release()
        account = privileges.who(self.config)
        return await certificates.install(self.api, node, ref.vm_id, certificate, release, account)

    async def probe_ssh(self, ref: VMRef, address: ipaddress.IPv4Address, port: int) -> str | None:
        return await self._ssh.probe(address, port)

    # --- rollback ----------------------------------------------------------------------

    async def power_off(self, ref: VMRef) -> None:
        """Stop (hard) and wait for the stop task: a destroy must not race it."""
        try:
            node, template = await self._place_of(ref)
        except VMNotFound:
            return
        pace = Pace(self.pacing, "stop", template)
        await rollback.stop(self.api, self.tasks, node, ref.vm_id, pace)

    async def destroy(self, ref: VMRef) -> None:
        """Delete with its disks, backup jobs and HA entry, and wait; gone is done. The
        job's tag is checked again before each try (see `rollback.destroy`)."""
        self.agent.forget(ref.vm_id)
        self._resize_targets.pop((ref.vm_id, ref.job_id), None)
        owned = functools.partial(self._place_of, ref)
        try:
            await rollback.destroy(self.api, self.tasks, owned, ref.vm_id, self.pacing)
        finally:  # gone, or maybe gone: a false "free" is caught by check_free's store
            self.address_sweep.forget(ref.vm_id)

    async def _place_of(self, ref: VMRef) -> tuple[str, str]:
        """The node and template of the ref's VM, once its tag was checked."""
        node, config = await self._owned(ref)
        return node, mark_field(config, "template") or ""

    # --- template builds (building.py) ----------------------------------------------

    async def build_preflight(self, plan: BuildPlan) -> BuildTarget:
        return await self.builds.preflight(plan)

    async def prepare_build(self, plan: BuildPlan, target: BuildTarget) -> VMRef:
        return await self.builds.prepare(plan, target)

    async def create_template(
        self, plan: BuildPlan, target: BuildTarget, ref: VMRef, image: Path | None
    ) -> str | None:
        if image is None:
            raise PermanentError("a Proxmox template is built from an image: none was prepared")
        return await self.builds.create(plan, target, ref, image)

    async def publish_template(self, plan: BuildPlan, ref: VMRef) -> str | None:
        return await self.builds.publish(plan, ref)

    async def template_versions(self, name: str | None = None) -> list[TemplateVersion]:
        return await self.builds.versions(name)

    async def destroy_template(self, ref: VMRef) -> None:
        await self.builds.destroy(ref)

    async def close(self) -> None:
        await self._ssh.close()
        await self.api.close()
