"""The NetBox harness (tests/support/netbox/harness.py) gives a real NetBox that hands out
addresses, refuses bad tokens, and can go away and come back."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pynetbox
import pytest
import requests

from tests.support.netbox.harness import NetBox

PREFIX = "10.99.0.0/24"


def status_code(call: Any) -> int:
    with pytest.raises(pynetbox.RequestError) as raised:
        call()
    return int(raised.value.req.status_code)


def test_next_free_address_and_two_at_once_differ(clean_netbox: NetBox) -> None:
    prefix = clean_netbox.api().ipam.prefixes.create(prefix=PREFIX)
    assert str(prefix.available_ips.list()[0]) == "10.99.0.1/24"

    # Two clients ask for the next free address at the same moment.
    both = threading.Barrier(2)

    def take() -> str:
        mine = clean_netbox.api().ipam.prefixes.get(prefix.id)
        both.wait(timeout=30)
        return str(mine.available_ips.create().address)

    with ThreadPoolExecutor(2) as pool:
        first, second = (f.result() for f in [pool.submit(take), pool.submit(take)])
    assert first != second
    assert {first, second} == {"10.99.0.1/24", "10.99.0.2/24"}


def test_bad_tokens_are_refused(clean_netbox: NetBox) -> None:
    clean_netbox.api().ipam.prefixes.create(prefix=PREFIX)
    invalid = clean_netbox.api(clean_netbox.invalid_token)
    assert status_code(lambda: list(invalid.ipam.prefixes.all())) == 403

    reader = clean_netbox.api(clean_netbox.read_only_token)
    assert [str(p) for p in reader.ipam.prefixes.all()] == [PREFIX]
    assert status_code(lambda: reader.ipam.ip_addresses.create(address="10.99.0.9/24")) == 403


def test_stop_and_start_on_the_same_port(clean_netbox: NetBox) -> None:
    clean_netbox.api().ipam.prefixes.create(prefix=PREFIX)
    status = f"{clean_netbox.url}/api/status/"
    clean_netbox.stop()
    with pytest.raises(requests.ConnectionError):
        requests.get(status, headers=clean_netbox.headers(), timeout=10)
    clean_netbox.start()
    answer = requests.get(status, headers=clean_netbox.headers(), timeout=10)
    assert answer.status_code == 200
    assert answer.json()["netbox-version"] == "4.7.3"
    assert [str(p) for p in clean_netbox.api().ipam.prefixes.all()] == [PREFIX]
