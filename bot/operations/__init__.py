"""Operators' tools: `deploybot check` (`check`), garbage collection of VMs with no
business existing (`gc`), and Prometheus metrics (`metrics`)."""
