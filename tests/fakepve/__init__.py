"""A faithful fake of the Proxmox VE API, for deploybot's tests, benchmark and demo.

    python -m tests.fakepve --port 8006 --ssh-port 2222

See `server.FakePVE` (HTTPS, auth, schema checks, recording), `ops` (the endpoints),
`cluster` (state, tasks, faults) and `guest` (agent interfaces, sshd on 127.0.0.0/8).
"""

from tests.fakepve.cluster import Cluster, Fault, Timings
from tests.fakepve.schema import ApiSchema
from tests.fakepve.server import SESSION_REQUESTS, FakePVE, Recorded, Tls, make_tls

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
