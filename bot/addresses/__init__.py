"""Addresses: the `[[subnets]]` deploybot hands out of and which one a request uses
(`subnets`), the next free address and the IPAM's record (`allocation`), and the
optional reachability probe (`probe`)."""
