"""What the vSphere backend says when it cannot be used as configured (issue 11, item 6):
a refused password, a certificate not trusted by the CA given or by none, a network
that is an uplink portgroup. All permanent, all naming the setting to check."""

from __future__ import annotations

from pathlib import Path

import pytest

from backends.base import CloneSpec, PermanentError
from backends.vsphere import Config, create
from tests.vcsim_support import (
    PASSWORD,
    PASSWORD_ENV,
    TEMPLATE,
    Simulated,
    TlsFiles,
    Vcsim,
    make_tls,
    vcenter_fixture,  # noqa: F401
    vcsim_binary_fixture,  # noqa: F401
    vcsim_tls_fixture,  # noqa: F401
)

USER = "deploybot@vsphere.local"


def never_try_again(message: str) -> None:
    assert "try again" not in message and "does not answer" not in message


async def test_a_refused_password_is_permanent_and_names_its_variable(
    vcsim_binary: Path, vcsim_tls: TlsFiles, tmp_path: Path
) -> None:
    sim = Vcsim(vcsim_binary, vcsim_tls, tmp_path, esx=False, login=(USER, PASSWORD))
    right = create(Config.model_validate(sim.config(user=USER)), {PASSWORD_ENV: PASSWORD})
    wrong = create(Config.model_validate(sim.config(user=USER)), {PASSWORD_ENV: "not-it-93b1"})
    try:
        assert await right.is_vcenter()  # the right password does log in
        with pytest.raises(PermanentError) as refused:
            await wrong.templates()
    finally:
        await right.close()
        await wrong.close()
        sim.stop()
    assert not refused.value.retryable
    message = refused.value.message
    assert f"the password of {USER} was refused by 127.0.0.1:{sim.port}" in message
    assert f"check ${PASSWORD_ENV}" in message and "not-it-93b1" not in message
    never_try_again(message)


async def test_a_ca_bundle_that_is_not_the_signer_is_named(
    vcenter: Simulated, tmp_path: Path
) -> None:
    """With a ca_bundle given, "set ca_bundle" is no advice: the one given is wrong."""
    other = make_tls(tmp_path)
    backend = vcenter.sim.backend(ca_bundle=str(other.ca))
    try:
        with pytest.raises(PermanentError) as untrusted:
            await backend.templates()
    finally:
        await backend.close()
    message = untrusted.value.message
    assert f"by ca_bundle {other.ca}: check that it holds the CA" in message
    assert "set ca_bundle =" not in message
    assert "key too small" not in message
    never_try_again(message)


async def test_an_uplink_portgroup_is_neither_offered_nor_accepted(vcenter: Simulated) -> None:
    """vcsim's distributed switch has an uplink portgroup (`DC0_DVS-DVUplinks-<n>`), which
    carries the hosts' physical NICs: a VM's NIC does not belong there."""
    uplinks = [n for n in vcenter.sim.network_names() if "-DVUplinks-" in n]
    assert uplinks, "vcsim no longer creates an uplink portgroup"
    backend = vcenter.sim.backend()
    try:
        offered = [n.name for n in await backend.networks()]
        assert "DC0_DVPG0" in offered and uplinks[0] not in offered
        with pytest.raises(PermanentError, match=f"no network '{uplinks[0]}' on vcenter"):
            await backend.prepare_clone(CloneSpec("jvs0009", "web09", TEMPLATE, network=uplinks[0]))
    finally:
        await backend.close()
