from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest

from bot.config.settings import Settings
from bot.models.errors import RequestInvalid, UsageError
from bot.requests.grammar import parse
from bot.requests.parsed import DeployArgs
from bot.requests.validation import build_request
from tests.support.deployer import make_settings


def build(text: str, settings: Settings, requester: str = "alice"):  # type: ignore[no-untyped-def]
    args = parse(text)
    return build_request(args, settings, requester)  # type: ignore[arg-type]


def problems(text: str, settings: Settings) -> str:
    with pytest.raises(RequestInvalid) as caught:
        build(text, settings)
    return str(caught.value)


def test_defaults_come_from_the_subnet_and_config(settings: Settings) -> None:
    req = build("Web01 10.0.0.50", settings)
    assert req.name == "web01"
    assert req.address == ipaddress.IPv4Interface("10.0.0.50/24")
    assert req.gateway == ipaddress.IPv4Address("10.0.0.1")
    assert [str(d) for d in req.dns] == ["10.0.0.2", "10.0.0.3"]
    assert req.search_domain == "lab.example"
    assert (req.template, req.backend, req.cores, req.memory_mib) == (
        "ubuntu-24.04",
        "sim",
        2,
        2048,
    )
    assert req.user == "ubuntu"
    assert req.upgrade is False
    assert req.requester == "alice"


def test_options_override_defaults(settings: Settings) -> None:
    req = build("db1 10.0.0.60/24 cpu=4 mem=8G disk=+20G user=admin upgrade=yes on=node2", settings)
    assert (req.cores, req.memory_mib, req.disk_grow_gib, req.user, req.upgrade) == (
        4,
        8192,
        20,
        "admin",
        True,
    )
    assert (req.backend, req.placement) == ("sim", "node2")


def test_on_names_a_backend_or_backend_slash_node(tmp_path: Path) -> None:
    settings = make_settings(
        tmp_path,
        backends=[{"kind": "sim", "name": "sim"}, {"kind": "sim", "name": "lab2"}],
    )
    assert build("a 10.0.0.9 on=lab2", settings).backend == "lab2"
    req = build("a 10.0.0.9 on=lab2/node1", settings)
    assert (req.backend, req.placement) == ("lab2", "node1")


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("-web 10.0.0.50", "not a valid host name"),
        ("web- 10.0.0.50", "not a valid host name"),
        ("we_b 10.0.0.50", "not a valid host name"),
        ("w" * 64 + " 10.0.0.50", "1-63 letters"),
        ("web01 10.0.0.9 subnet=10.0.0.0/24", "not both"),
        ("web01 subnet=lab9", "'lab9' is not a subnet; choose one of lab (10.0.0.0/24)"),
        ("web01 10.0.0", "is not an IPv4 address"),
        ("web01 fe80::1", "is not an IPv4 address"),
        ("web01 192.168.5.5", "not in a subnet deploybot may use (lab (10.0.0.0/24))"),
        ("web01 10.0.0.0", "network address of 10.0.0.0/24"),
        ("web01 10.0.0.255", "broadcast address of 10.0.0.0/24"),
        ("web01 10.0.0.1", "is the gateway"),
        ("web01 10.0.0.50/16", "drop the prefix or write /24"),
        ("web01 10.0.0.50 cpu=64", "cpu: 64 is over the limit of 16"),
        ("web01 10.0.0.50 mem=128G", "mem: 131072 MiB is over the limit of 65536 MiB"),
        ("web01 10.0.0.50 disk=+5000G", "disk: 5000 GiB is over the limit of 1024 GiB"),
        ("web01 10.0.0.50 user=Root", "not a valid login name"),
    ],
)
def test_bad_requests_say_what_is_wrong(settings: Settings, text: str, fragment: str) -> None:
    assert fragment in problems(text, settings)


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("web01 mem=0G", "mem=0G is too little: a VM needs at least 0.25G (256M); ask for"),
        ("web01 mem=255M", "mem=255M is too little: a VM needs at least 256M; ask for mem=256M"),
        ("web01 mem=128MiB", "mem=128MiB is too little: a VM needs at least 256M;"),
    ],
)
def test_too_little_memory_is_said_in_the_unit_typed(text: str, said: str) -> None:
    """Issue 25, item 8: not pydantic's "Input should be greater than or equal to 256"."""
    with pytest.raises(UsageError) as caught:
        parse(text)
    assert said in caught.value.problem
    assert "greater than or equal" not in str(caught.value)


def test_too_little_memory_from_a_form_is_said_in_mib(settings: Settings) -> None:
    """A form builds `DeployArgs` itself: the request says it, in MiB, with the rest."""
    with pytest.raises(RequestInvalid) as caught:
        build_request(DeployArgs("web01", "10.0.0.50", memory_mib=100, cores=99), settings, "al")
    assert "mem: 100 MiB is too little: a VM needs at least 256 MiB." in caught.value.problems
    assert caught.value.fields["memory_mib"].startswith("mem: 100 MiB")
    assert "greater than or equal" not in str(caught.value)


def test_every_problem_is_reported_at_once(settings: Settings) -> None:
    message = problems("web01 10.9.9.9 cpu=99 mem=999G", settings)
    assert "not in a subnet" in message
    assert "cpu: 99" in message
    assert "mem: " in message
