"""`deploybot check`'s backend checks against vcsim, vCenter and ESXi: the connection,
the default template, datastore and network, and the privileges asked of the
AuthorizationManager (HasPrivilegeOnEntity) on the objects a clone uses.

vcsim grants every privilege to everyone (its HasPrivilegeOnEntity answers true for
any privilege), so only the passing side can be shown here; a missing privilege is
shown against the fake Proxmox (tests/test_check.py)."""

from __future__ import annotations

import pytest

from bot.operations.check import check_backend
from tests.support.vsphere.simulator import (
    TEMPLATE,
    Simulated,
    esxi_fixture,  # noqa: F401
    vcenter_fixture,  # noqa: F401
    vcsim_binary_fixture,  # noqa: F401
    vcsim_tls_fixture,  # noqa: F401
)


@pytest.mark.parametrize("kind", ["vcenter", "esxi"])
async def test_every_check_passes_and_the_privileges_are_asked(
    kind: str, request: pytest.FixtureRequest
) -> None:
    sim: Simulated = request.getfixturevalue(kind)
    backend = sim.sim.backend(datastore="LocalDS_0")
    try:
        results = await check_backend(kind, backend, TEMPLATE)
        calls = backend.api_calls()
    finally:
        await backend.close()
    assert all(r.ok for r in results), results
    names = [r.name for r in results]
    assert f"{kind}: template {TEMPLATE}" in names
    assert f"{kind}: storage LocalDS_0" in names
    assert f"{kind}: privileges" in names
    assert (f"{kind}: network DC0_DVPG0" in names) == (kind == "vcenter")
    # One question per object: template, folder, pool, datastore (and network).
    assert calls["HasPrivilegeOnEntity"] == (5 if kind == "vcenter" else 3)


async def test_a_missing_datastore_and_template_are_problems(vcenter: Simulated) -> None:
    backend = vcenter.sim.backend(datastore="nope")
    try:
        results = await check_backend("vcenter", backend, "no-such")
    finally:
        await backend.close()
    failed = {r.name: r for r in results if not r.ok}
    # The privileges are asked on the template and the datastore: not checked, not "ok".
    assert set(failed) == {
        "vcenter: template no-such",
        "vcenter: storage nope",
        "vcenter: privileges",
    }, results
    assert failed["vcenter: privileges"].detail.startswith("not checked: ")
    assert "LocalDS_0" in failed["vcenter: storage nope"].detail
    assert TEMPLATE in failed["vcenter: template no-such"].detail
