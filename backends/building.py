"""The template builder's contract: an optional ability of a backend (issue 17).

A build turns a prepared image (a customised qcow2 on the bot host, made by
`bot.images.prepare_image`) into a template on the hypervisor, then publishes it under
its plain name once a smoke deploy from it answered on SSH. A backend that can build
implements `BuildsTemplates` beside `Backend`; `backends/sim/` does, so the demo and
the core's tests build too.

Contract (beside the one in `backends/base.py`, which still holds):

* `build_preflight` only reads. It refuses (`PermanentError`, saying what is wrong and
  what to do) before anything is downloaded or created: the placement lacks the
  profile's CPU baseline (`x86-64-v3` needs avx2), the storage cannot hold what the
  build needs (disk images; on Proxmox also an upload target, content `import` or
  `iso`), `versioned_name` is taken, or `name` is held by something that is not a
  template this installation built (a VM, a hand-made template).
* `prepare_build` chooses the durable id (a VMID) without creating anything, so a crash
  in the middle of `create_template` still leaves the caller knowing what to remove.
* `create_template` uploads the image, creates the VM from it carrying `plan.tag` (and
  the build's marks: profile, version, build date, CPU baseline) under
  `plan.versioned_name`, converts it to a template, and removes the uploaded file. It
  returns only when every task ended. A file it uploaded is named after the build's
  job id, so `destroy_template` finds and removes one a crash left behind.
* `publish_template` makes the template the one called `plan.name`: it renames the new
  one first, then the previous current one (a template built by deploybot, else it is
  left alone and the call fails) to its own versioned name. Two templates may share the
  name for a moment, never none; a deploy takes the lowest id, the older one. Running it
  again after a crash finishes the job.
* `destroy_template` removes a template (or the half-built VM) that carries the job tag
  of `ref`, and any upload of that job left on the storage; `NotOurVM` otherwise; gone
  already is quiet. Rollback of a build and `template gc --apply` use it.
* A clone never inherits a job tag from its template: each backend drops inherited job
  marks, so a deploy from a built template carries its own job's tag only.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Protocol, runtime_checkable

from backends.base import VMRef
from backends.tags import JobMark, job_tag


@dataclass(frozen=True)
class BuildPlan:
    """One template build: everything the backend needs, nothing it has to look up."""

    job_id: str
    profile: str  # the build profile's name (bot/images/catalogue.toml): debian-12
    os_family: str  # debian, ubuntu, el
    version: int  # 1, 2, ...: one more than the highest built under `name` so far
    name: str  # the published name: debian-12
    cpu: str  # the profile's CPU baseline: x86-64-v2-AES or x86-64-v3
    ostype: str  # Proxmox ostype (l26); vSphere derives its guest id from os_family
    nic: str  # virtio, e1000, vmxnet3
    disk_bus: str  # scsi, virtio, sata, ide
    user: str  # the image's login user
    built_at: datetime
    source_digest: str  # sha256:<hex> of the upstream image
    placement: str | None = None  # None: the backend's choice
    storage: str | None = None  # None: the backend's default
    cores: int = 2
    memory_mib: int = 2048
    installation: str | None = None
    # Set when the prepared image is the upstream qcow2 unchanged: a backend that can
    # have the hypervisor fetch and verify it itself (Proxmox `download-url`) may do so
    # instead of uploading the image from the bot host. `source_digest` verifies it.
    source_url: str | None = None

    @property
    def tag(self) -> str:
        return job_tag(self.job_id, self.installation)

    @property
    def versioned_name(self) -> str:
        return f"{self.name}-v{self.version}"

    def ref(self, vm_id: str, placement: str | None) -> VMRef:
        return VMRef(vm_id, self.job_id, placement, self.installation)


@dataclass(frozen=True)
class BuildTarget:
    """Where the build goes, as `build_preflight` resolved it."""

    placement: str
    storage: str
    notes: tuple[str, ...] = ()  # what the check found worth saying (in words)


@dataclass(frozen=True)
class TemplateVersion:
    """One template deploybot built (read from the hypervisor's marks on it)."""

    vm_id: str
    name: str  # as it is called now: debian-12 (current) or debian-12-v2
    base_name: str  # the name it is published under: debian-12
    profile: str
    version: int
    built_at: datetime | None
    cpu: str | None
    mark: JobMark | None  # the build job that made it
    placement: str | None
    # VMs that still need it (Proxmox linked clones on its base volumes): it is kept
    # while any do.
    used_by: tuple[str, ...] = ()

    @property
    def current(self) -> bool:
        return self.name == self.base_name


@runtime_checkable
class BuildsTemplates(Protocol):
    """A backend that can build templates. See the module docstring for the contract."""

    # Which image the build prepares for it (bot/images: "proxmox", "vsphere"); None: the
    # backend takes no image (the simulator), and `create_template` gets None.
    image_platform: str | None

    async def build_preflight(self, plan: BuildPlan) -> BuildTarget: ...

    async def prepare_build(self, plan: BuildPlan, target: BuildTarget) -> VMRef: ...

    async def create_template(
        self, plan: BuildPlan, target: BuildTarget, ref: VMRef, image: Path | None
    ) -> str | None: ...

    async def publish_template(self, plan: BuildPlan, ref: VMRef) -> str | None: ...

    async def template_versions(self, name: str | None = None) -> list[TemplateVersion]:
        """Every template deploybot built on this endpoint (of `name`, when given)."""
        ...

    async def destroy_template(self, ref: VMRef) -> None: ...
