"""The pre-flight of a NIC's segment on a node, before anything is cloned: the bridge
exists there, and a VLAN tag is asked only of a bridge that can carry it.

A Linux bridge carries tags only when it is VLAN-aware (`bridge_vlan_aware` in
`GET /nodes/{node}/network`), and then only the VLANs of its `bridge_vids` (default
2-4094); an Open vSwitch bridge always can. Proxmox itself writes `tag=20` on any
bridge without a word: the guest then boots on a bridge that drops or untags its
frames and never answers, so the refusal comes here, naming the bridge and the node.
Bridges are read per node once per `discovery_cache_s` (concurrent deploys share it).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from backends.base import PermanentError, Segment
from backends.proxmox.api import PveApi

# What a VLAN-aware Linux bridge allows when its `bridge_vids` is not set (ifupdown2).
_DEFAULT_VIDS = "2-4094"


@dataclass(frozen=True)
class Bridge:
    name: str
    kind: str  # bridge, OVSBridge, ...
    vlan_aware: bool
    vids: str  # "2 4 100-200": the VLANs a VLAN-aware bridge carries

    def carries(self, vlan: int) -> bool:
        if self.kind == "OVSBridge":
            return True
        return self.vlan_aware and vlan in _vid_set(self.vids)


class Bridges:
    """The bridges of each node, read at most once per `cache_s`."""

    def __init__(self, api: PveApi, cache_s: float) -> None:
        self.api = api
        self.cache_s = cache_s
        self._read: dict[str, tuple[float, dict[str, Bridge]]] = {}
        self._flights: dict[str, asyncio.Task[dict[str, Bridge]]] = {}

    async def on(self, node: str, max_age_s: float | None = None) -> dict[str, Bridge]:
        """The node's bridges, as read at most `max_age_s` ago (None: `cache_s`)."""
        now = asyncio.get_running_loop().time()
        kept = self._read.get(node)
        age_s = self.cache_s if max_age_s is None else max_age_s
        if kept is not None and now - kept[0] < age_s:
            return kept[1]
        flight = self._flights.get(node)
        if flight is None:
            flight = asyncio.ensure_future(self._ask(node))
            self._flights[node] = flight
            flight.add_done_callback(lambda _done: self._flights.pop(node, None))
        found = await asyncio.shield(flight)
        self._read[node] = (now, found)
        return found

    async def _ask(self, node: str) -> dict[str, Bridge]:
        items: list[dict[str, Any]] = await self.api.get(
            f"nodes/{node}/network", "bridge list", type="any_bridge"
        )
        return {
            str(i["iface"]): Bridge(
                str(i["iface"]),
                str(i.get("type", "bridge")),
                bool(i.get("bridge_vlan_aware")),
                str(i.get("bridge_vids") or _DEFAULT_VIDS),
            )
            for i in items
        }

    async def check(self, segment: Segment, node: str, backend: str) -> None:
        """Refuse (`PermanentError`) a segment the node cannot put a NIC on; what a kept
        read refuses is asked afresh first (an operator may have just fixed it)."""
        if _fits(segment, await self.on(node)):
            return
        bridges = await self.on(node, 0.0)
        bridge = bridges.get(segment.network)
        if bridge is None:
            have = ", ".join(sorted(bridges)) or "none"
            raise PermanentError(
                f"bridge {segment.network} does not exist on node {node} of {backend} "
                f"(bridges there: {have}): create it on every node deploys may use, or "
                "correct the subnet's [subnets.segments] bridge"
            )
        if segment.vlan is None or bridge.carries(segment.vlan):
            return
        if not bridge.vlan_aware:
            raise PermanentError(
                f"bridge {bridge.name} on node {node} of {backend} is not VLAN-aware, so a "
                f"NIC tagged VLAN {segment.vlan} there would reach nothing: make it VLAN-aware "
                f"(node {node} > Network > {bridge.name} > VLAN aware, or `bridge-vlan-aware "
                "yes` in /etc/network/interfaces), or give the subnet a bridge that carries "
                "that VLAN untagged and no vlan"
            )
        raise PermanentError(
            f"bridge {bridge.name} on node {node} of {backend} carries VLANs {bridge.vids}, "
            f"not {segment.vlan}: add it to the bridge's bridge-vids, or correct the subnet's "
            "vlan"
        )


def _fits(segment: Segment, bridges: dict[str, Bridge]) -> bool:
    bridge = bridges.get(segment.network)
    return bridge is not None and (segment.vlan is None or bridge.carries(segment.vlan))


def _vid_set(vids: str) -> set[int]:
    """'2 4 100-200' (spaces or commas) as the set of VLAN ids."""
    found: set[int] = set()
    for part in vids.replace(",", " ").split():
        low, _, high = part.partition("-")
        if low.isdigit() and (not high or high.isdigit()):
            found.update(range(int(low), int(high or low) + 1))
    return found
