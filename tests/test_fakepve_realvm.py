"""Where a real guest of the fake Proxmox sits in QEMU's user-mode network (no QEMU
needed): QEMU wants its own address and its resolver inside the guest's network. And
what its fault knobs change: the seed (unparsable, same instance-id) and the kernel
command line (the agent masked)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.support.fakepve.realvm import AGENT_UNIT, DEFAULT_LAN, Lan, broken, lan
from tests.support.realguest import nocloud, qemu


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


def test_a_broken_seed_does_not_parse_but_keeps_its_instance_id() -> None:
    config = {"name": "b", "net0": "virtio=BC:24:11:00:00:01", "ipconfig0": "ip=10.0.0.5/24"}
    seed = nocloud.render(config, 101)
    bad = broken(seed)
    assert bad.instance_id == seed.instance_id
    for good, text in ((seed.user_data, bad.user_data), (seed.network_config, bad.network_config)):
        yaml.safe_load(good)
        with pytest.raises(yaml.YAMLError):
            yaml.safe_load(text)


def test_extra_kernel_arguments_follow_the_usual_ones() -> None:
    guest = qemu.Guest(Path("/img"), Path("/w"), Path("/w/seed.iso"), "BC:24:11:00:00:01", "")
    usual = guest.argv([])
    append = usual[usual.index("-append") + 1]
    guest.append = f"systemd.mask={AGENT_UNIT}"
    masked = guest.argv([])
    assert masked[masked.index("-append") + 1] == f"{append} systemd.mask=qemu-guest-agent.service"
