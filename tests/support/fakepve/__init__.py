"""A faithful fake of the Proxmox VE API, for deploybot's tests, benchmark and demo.

    python -m tests.support.fakepve --port 8006 --ssh-port 2222

See `server.FakePVE` (HTTPS, auth, schema checks, recording), `ops` (the endpoint
table; `reads` and `mutations` answer), `cluster` (state, tasks, faults), `machines`
(what VMs are: simulated by default, with `guest`'s agent interfaces and sshd on
127.0.0.0/8) and `realvm` (real QEMU guests instead).
"""

from tests.support.fakepve.cluster import Cluster, Fault, Timings
from tests.support.fakepve.schema import ApiSchema
from tests.support.fakepve.server import SESSION_REQUESTS, FakePVE, Recorded, Tls, make_tls

__all__ = [
    "SESSION_REQUESTS",
    "ApiSchema",
    "Cluster",
    "FakePVE",
    "Fault",
    "Recorded",
    "Timings",
    "Tls",
    "make_tls",
]
