"""Where a real guest of the fake Proxmox sits in QEMU's user-mode network (no QEMU
needed): QEMU wants its own address and its resolver inside the guest's network."""

from __future__ import annotations

from tests.fakepve.realvm import DEFAULT_LAN, Lan, lan


def test_the_gateway_and_nameserver_of_ipconfig0_are_qemus() -> None:
    config = {"ipconfig0": "ip=10.0.0.50/24,gw=10.0.0.1", "nameserver": "10.0.0.2 10.0.0.9"}
    assert lan(config) == Lan("10.0.0.50", "10.0.0.0/24", "10.0.0.1", "10.0.0.2")


def test_addresses_qemu_cannot_take_are_replaced_by_free_ones() -> None:
    # A resolver outside the network, no gateway: the first free hosts instead.
    config = {"ipconfig0": "ip=192.168.7.1/28", "nameserver": "1.1.1.1"}
    assert lan(config) == Lan("192.168.7.1", "192.168.7.0/28", "192.168.7.2", "192.168.7.3")
    # A gateway outside the network, a resolver that is the guest itself.
    config = {"ipconfig0": "ip=10.1.0.5/16,gw=10.2.0.1", "nameserver": "10.1.0.5"}
    assert lan(config) == Lan("10.1.0.5", "10.1.0.0/16", "10.1.0.1", "10.1.0.2")


def test_without_a_static_address_qemus_defaults() -> None:
    assert lan({}) == DEFAULT_LAN
    assert lan({"ipconfig0": "ip=dhcp"}) == DEFAULT_LAN
    assert not DEFAULT_LAN.static
