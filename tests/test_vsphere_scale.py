"""The vSphere backend's cost does not grow with the inventory: a deploy's template
lookup and clone make the same SOAP requests, and read the same bytes (within a small
constant: longer object ids), with 200 VMs more in vcsim; and container views are made
once per session, not per lookup. Counted at the SOAP transport, not timed."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from backends.base import CloneSpec
from tests.vcsim_support import (
    TEMPLATE,
    TlsFiles,
    simulator,
    vcsim_binary_fixture,  # noqa: F401
    vcsim_tls_fixture,  # noqa: F401
)

EXTRA = 200  # VMs more than vcsim's default inventory (2 per resource pool, 2 pools)
SLACK_BYTES = 2000  # ids like vm-1234 instead of vm-12, in a few answers


async def deploy_cost(
    binary: Path, tls: TlsFiles, tmp: Path, per_pool: int
) -> tuple[Counter[str], int]:
    """SOAP calls and bytes of two deploys' template lookup and clone, after a first
    one that logged in and learnt the inventory."""
    with simulator(binary, tls, tmp, esx=False, vms_per_pool=per_pool) as lab:
        assert len(lab.sim.vms()) >= 4 + (per_pool - 2) * 2
        backend = lab.sim.backend()
        try:
            first = CloneSpec("jsc0000", "warm00", TEMPLATE)
            await backend.clone(first, await backend.prepare_clone(first))
            calls, sent = backend.api_calls(), backend.api_bytes()
            for i in (1, 2):
                spec = CloneSpec(f"jsc000{i}", f"web0{i}", TEMPLATE)
                await backend.clone(spec, await backend.prepare_clone(spec))
            return backend.api_calls() - calls, sum((backend.api_bytes() - sent).values())
        finally:
            await backend.close()


async def test_deploy_cost_does_not_grow_with_the_vms(
    vcsim_binary: Path, vcsim_tls: TlsFiles, tmp_path: Path
) -> None:
    small_calls, small_bytes = await deploy_cost(vcsim_binary, vcsim_tls, tmp_path, 2)
    big_calls, big_bytes = await deploy_cost(vcsim_binary, vcsim_tls, tmp_path, 2 + EXTRA // 2)
    print(
        f"per 2 deploys: {sum(small_calls.values())} calls, {small_bytes} B with 0 extra VMs; "
        f"{sum(big_calls.values())} calls, {big_bytes} B with {EXTRA}"
    )
    assert big_calls == small_calls
    assert abs(big_bytes - small_bytes) < SLACK_BYTES, (small_bytes, big_bytes)
    # Views are kept for the session: none is made or destroyed by a later deploy.
    assert big_calls["CreateContainerView"] == 0
    assert big_calls["DestroyView"] == 0
