"""The subnet's VLAN on the addresses deploybot reserves in a real NetBox (issue 29, item 1;
tests/support/netbox/harness.py starts one on 127.0.0.1).

NetBox 4 has no VLAN on an IP address: the prefix has it. With `[ipam] vlan_field`, each
reserved address gets its prefix's VLAN in that custom field (Object -> IPAM > VLAN).
The VLANs, prefixes and custom fields are made here through pynetbox, as an operator
would; the addresses exist only as NetBox data: nothing connects to them."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from backends.ipam.base import ReservedFor
from backends.ipam.config import IpamConfig
from backends.ipam.netbox import NetBox as NetBoxIpam
from backends.sim import SimBackend
from bot.addresses.subnets import Subnet
from bot.app.runtime import running_deployer
from bot.app.service import Deployer
from bot.config.settings import Settings
from bot.models import JobState
from bot.models.errors import RequestInvalid
from bot.operations.check import check_ipam
from bot.requests.grammar import parse
from bot.requests.parsed import DeployArgs
from handlers.messages.slack import check_lines
from tests.support.deployer import FAST_TIMEOUTS, SIM_SCALE, make_settings
from tests.support.netbox.harness import NetBox

TOKEN_ENV = "DEPLOYBOT_NETBOX_TOKEN"
FIELD = "vlan"
LAB = {
    "name": "lab",
    "cidr": "10.0.0.0/24",
    "gateway": "10.0.0.1",
    "search_domain": "lab.example",
    "segments": {"sim": {"bridge": "vmbr0"}},
}
LAB20 = {
    "name": "lab20",
    "cidr": "10.0.20.0/24",
    "gateway": "10.0.20.1",
    "segments": {"sim": {"bridge": "vmbr1", "vlan": 20}},
}


@pytest.fixture
def nb(clean_netbox: NetBox, monkeypatch: pytest.MonkeyPatch) -> Iterator[NetBox]:
    """A NetBox with the tag deploybot writes and the token in the environment; each test
    makes its prefixes, VLANs and custom field."""
    api = clean_netbox.api()
    api.extras.tags.create({"name": "deploybot", "slug": "deploybot"})
    monkeypatch.setenv(TOKEN_ENV, clean_netbox.token)
    yield clean_netbox


def prefix(nb: NetBox, cidr: str, vid: int | None = None, name: str = "") -> None:
    """The subnet's prefix, in VLAN `vid` (made, named `name` or backendVID) or none."""
    api = nb.api()
    fields: dict[str, Any] = {"prefix": cidr, "status": "active"}
    if vid is not None:
        vlan = api.ipam.vlans.create({"vid": vid, "name": name or f"backend{vid}"})
        fields["vlan"] = vlan.id
    api.ipam.prefixes.create(fields)


def vlan_field(nb: NetBox, kind: str = "object", on: str = "ipam.ipaddress") -> None:
    """The custom field an operator makes for deploybot: Object -> IPAM > VLAN on IPAM >
    IP address (or, to be refused, another type or another object type)."""
    fields: dict[str, Any] = {"name": FIELD, "type": kind, "object_types": [on]}
    if kind == "object":
        fields["related_object_type"] = "ipam.vlan"
    nb.api().extras.custom_fields.create(fields)


def settings_for(tmp_path: Path, nb: NetBox, subnets: list[dict[str, Any]]) -> Settings:
    return make_settings(
        tmp_path,
        subnets=subnets,
        ipam={"provider": "netbox", "url": nb.url, "vlan_field": FIELD},
        timeouts={**FAST_TIMEOUTS, "check_free_s": 60.0, "retry_max_s": 0.2},
    )


@pytest.fixture
async def two_subnets(tmp_path: Path, nb: NetBox) -> AsyncIterator[Deployer]:
    settings = settings_for(tmp_path, nb, [LAB, LAB20])
    sim = SimBackend("sim", time_scale=SIM_SCALE)
    async with running_deployer(settings, backends={"sim": sim}, grace_s=5) as d:
        yield d


async def ask(deployer: Deployer, text: str) -> Any:
    args = parse(text)
    assert isinstance(args, DeployArgs)
    return await deployer.request_deploy(args, "alice")


def vlan_of(nb: NetBox, address: str) -> tuple[int, str] | None:
    """The VLAN NetBox records on the address (its vid and name), None: none."""
    (record,) = nb.api().ipam.ip_addresses.filter(address=address)
    value = record.custom_fields[FIELD]
    return None if value is None else (value["vid"], value["name"])


async def test_a_reserved_address_carries_its_prefix_vlan(
    nb: NetBox, two_subnets: Deployer
) -> None:
    prefix(nb, "10.0.0.0/24", 10)
    prefix(nb, "10.0.20.0/24", 20)
    vlan_field(nb)
    picked = await ask(two_subnets, "web01 subnet=lab")
    asked = await ask(two_subnets, "web02 10.0.20.50")
    assert (picked.address, asked.address) == ("10.0.0.2", "10.0.20.50")
    assert vlan_of(nb, "10.0.0.2") == (10, "backend10")
    assert vlan_of(nb, "10.0.20.50") == (20, "backend20")
    await two_subnets.drain()
    done = (await two_subnets.status(picked.id)).job
    assert done.state is JobState.SUCCEEDED
    # Marked active by a change of status only: the VLAN stays.
    (record,) = nb.api().ipam.ip_addresses.filter(address="10.0.0.2")
    assert record.status.value == "active" and vlan_of(nb, "10.0.0.2") == (10, "backend10")
    # NetBox can list the addresses of a VLAN by the field.
    vlan20 = nb.api().ipam.vlans.get(vid=20)
    listed = nb.api().ipam.ip_addresses.filter(**{f"cf_{FIELD}": vlan20.id})
    assert [str(r.address) for r in listed] == ["10.0.20.50/24"]


async def test_each_nic_carries_its_own_subnets_vlan(nb: NetBox, two_subnets: Deployer) -> None:
    prefix(nb, "10.0.0.0/24", 10)
    prefix(nb, "10.0.20.0/24", 20)
    vlan_field(nb)
    job = await ask(two_subnets, "web01 10.0.0.50 +lab20")
    second = str(job.request.nics[0].address.ip)
    assert vlan_of(nb, "10.0.0.50") == (10, "backend10")
    assert vlan_of(nb, second) == (20, "backend20")


async def test_a_prefix_without_a_vlan_leaves_the_field_empty(
    nb: NetBox, two_subnets: Deployer
) -> None:
    prefix(nb, "10.0.0.0/24")  # no VLAN in NetBox
    prefix(nb, "10.0.20.0/24", 20)
    vlan_field(nb)
    job = await ask(two_subnets, "web01 10.0.0.50 +lab20")
    assert vlan_of(nb, "10.0.0.50") is None
    assert vlan_of(nb, str(job.request.nics[0].address.ip)) == (20, "backend20")


async def test_a_pool_takes_the_vlan_of_the_prefix_around_its_ip_range(
    tmp_path: Path, nb: NetBox
) -> None:
    prefix(nb, "10.0.20.0/24", 20)
    nb.api().ipam.ip_ranges.create(
        {"start_address": "10.0.20.100/24", "end_address": "10.0.20.110/24", "status": "active"}
    )
    vlan_field(nb)
    settings = settings_for(tmp_path, nb, [{**LAB20, "pool": "10.0.20.100-10.0.20.110"}])
    sim = SimBackend("sim", time_scale=SIM_SCALE)
    async with running_deployer(settings, backends={"sim": sim}, grace_s=5) as d:
        assert (await ask(d, "web01")).address == "10.0.20.100"
    assert vlan_of(nb, "10.0.20.100") == (20, "backend20")


async def test_a_missing_field_refuses_the_request_saying_what_to_make(
    nb: NetBox, two_subnets: Deployer
) -> None:
    prefix(nb, "10.0.0.0/24", 10)
    prefix(nb, "10.0.20.0/24", 20)
    with pytest.raises(RequestInvalid) as refused:
        await ask(two_subnets, "web01 10.0.0.50")
    message = refused.value.message
    assert (
        "NetBox has no custom field 'vlan': create custom field vlan of type Object (related "
        "object type IPAM > VLAN) on IPAM > IP address, or unset [ipam] vlan_field"
    ) in message, message
    assert "try again" not in message
    assert list(nb.api().ipam.ip_addresses.all()) == []
    assert await two_subnets.history() == []
    vlan_field(nb)  # made: the next request records its VLAN, no restart needed
    await ask(two_subnets, "web01 10.0.0.50")
    assert vlan_of(nb, "10.0.0.50") == (10, "backend10")
    # Deleted after deploybot found it right: NetBox's refusal says the same fix.
    nb.api().extras.custom_fields.get(name=FIELD).delete()
    with pytest.raises(RequestInvalid) as refused:
        await ask(two_subnets, "web02 10.0.0.51")
    message = refused.value.message
    assert "NetBox refused the VLAN in custom field 'vlan' (" in message, message
    assert message.endswith(
        "create custom field vlan of type Object (related object type IPAM > VLAN) on IPAM > "
        "IP address, or unset [ipam] vlan_field"
    ), message
    assert list(nb.api().ipam.ip_addresses.filter(address="10.0.0.51")) == []


async def test_check_says_the_field_is_missing_or_of_the_wrong_type(
    tmp_path: Path, nb: NetBox
) -> None:
    prefix(nb, "10.0.0.0/24", 10)
    settings = settings_for(tmp_path, nb, [LAB])
    (missing,) = await check_ipam(settings)  # the probe reservation still worked
    assert not missing.ok
    assert missing.detail == (
        "NetBox has no custom field 'vlan': create custom field vlan of type Object (related "
        "object type IPAM > VLAN) on IPAM > IP address, or unset [ipam] vlan_field"
    )
    vlan_field(nb, kind="integer")
    (wrong,) = await check_ipam(settings)
    assert wrong.detail.startswith(
        "NetBox's custom field 'vlan' is of type Integer, not Object (IPAM > VLAN): create "
    ), wrong.detail
    nb.api().extras.custom_fields.get(name=FIELD).delete()
    vlan_field(nb, on="ipam.prefix")
    (elsewhere,) = await check_ipam(settings)
    assert elsewhere.detail.startswith(
        "NetBox's custom field 'vlan' is not on IP addresses (it is on ipam.prefix)"
    ), elsewhere.detail
    assert list(nb.api().ipam.ip_addresses.all()) == []  # every probe given back


async def test_a_token_that_may_not_view_custom_fields_is_told_so(nb: NetBox) -> None:
    """The reader's user may view IPAM objects only: not the custom field."""
    prefix(nb, "10.0.20.0/24", 20)
    vlan_field(nb)
    config = IpamConfig(provider="netbox", url=nb.url, vlan_field=FIELD, tags=())
    ipam = NetBoxIpam.create(config, {TOKEN_ENV: nb.read_only_token})
    try:
        said = await ipam.problems([Subnet.model_validate(LAB20).as_pool()])
    finally:
        await ipam.close()
    assert said[0] == (
        f"NetBox refused to show custom field 'vlan' to the token in {TOKEN_ENV}: give its "
        "user permission to view custom fields, or unset [ipam] vlan_field"
    )
    assert said[1].startswith(f"subnet lab20: NetBox refused the token in {TOKEN_ENV}")


async def test_check_warns_when_netbox_and_the_segment_name_other_vlans(
    tmp_path: Path, nb: NetBox
) -> None:
    prefix(nb, "10.0.0.0/24", 10)  # lab's segment has no tag: nothing to compare
    prefix(nb, "10.0.20.0/24", 30, name="storage")  # lab20's tags VLAN 20
    settings = settings_for(tmp_path, nb, [LAB, LAB20])
    # Said with the problems, when there are some: all at once.
    missing, mismatch = await check_ipam(settings)
    assert (missing.ok, mismatch.ok, mismatch.warning) == (False, True, True)
    assert missing.detail.startswith("NetBox has no custom field 'vlan'")
    vlan_field(nb)
    results = await check_ipam(settings)
    assert results[1] == mismatch
    assert [(r.ok, r.warning) for r in results] == [(True, False), (True, True)]
    assert results[0].detail.endswith("each address records its prefix's VLAN in vlan")
    warning = results[1]
    assert warning.name == "ipam: subnet lab20 VLAN"
    assert warning.detail == (
        "NetBox's prefix 10.0.20.0/24 is in VLAN 30 (storage), but the subnet's segment on "
        "sim is vmbr1 VLAN 20"
    )
    assert warning.fix == (
        "make them one VLAN: the prefix's VLAN in NetBox, or vlan in [subnets.segments.sim] "
        "of lab20"
    )
    lines = check_lines(results)
    assert lines[-1] == "All checks passed. 1 warning(s): read them above."
    assert any(line.startswith("WARNING  ipam: subnet lab20 VLAN: NetBox's") for line in lines)
    # The same VLAN on both sides: nothing to say.
    agreeing = [{**LAB20, "segments": {"sim": {"bridge": "vmbr1", "vlan": 30}}}]
    (ok,) = await check_ipam(settings_for(tmp_path, nb, agreeing))
    assert ok.ok and not ok.warning


async def count_calls(ipam: NetBoxIpam, pool: Any, n: int) -> list[int]:
    """How many HTTP requests each of `n` next-free reservations made."""
    seen: list[str] = []
    ipam.api.http_session.hooks["response"].append(
        lambda answer, *args, **kwargs: seen.append(answer.url)
    )
    counts = []
    for i in range(n):
        before = len(seen)
        await ipam.reserve(pool, ReservedFor(f"jcount{i}", "count", f"web{i}", f"web{i}"))
        counts.append(len(seen) - before)
    return counts


@pytest.mark.parametrize("field", [None, FIELD], ids=["without", "with"])
async def test_the_vlan_costs_no_call_per_reservation(nb: NetBox, field: str | None) -> None:
    """The VLAN comes with the prefix deploybot looks up anyway (once a process); the
    field is checked once a process: every reservation after the first is one POST."""
    prefix(nb, "10.0.20.0/24", 20)
    vlan_field(nb)
    # The gateway recorded, as an estate has it (else NetBox offers it first, and each
    # reservation costs a POST and a DELETE more, with or without the VLAN).
    nb.api().ipam.ip_addresses.create({"address": "10.0.20.1/24", "status": "active"})
    config = IpamConfig(provider="netbox", url=nb.url, vlan_field=field)
    ipam = NetBoxIpam.create(config, {TOKEN_ENV: nb.token})
    pool = Subnet.model_validate(LAB20).as_pool()
    try:
        counts = await count_calls(ipam, pool, 3)
    finally:
        await ipam.close()
    # The prefix (and, with the field, the field), then the POST to available-ips.
    assert counts == ([3, 1, 1] if field else [2, 1, 1])
    assert vlan_of(nb, "10.0.20.2") == ((20, "backend20") if field else None)


def test_vlan_field_is_netbox_s_and_a_custom_field_name() -> None:
    with pytest.raises(ValidationError, match='it goes with provider = "netbox"'):
        IpamConfig(vlan_field="vlan")
    with pytest.raises(ValidationError, match="'VLAN' is not a NetBox custom field name"):
        IpamConfig(provider="netbox", url="https://netbox.example/", vlan_field="VLAN")
    assert IpamConfig(provider="netbox", url="https://n.example/").vlan_field is None
