"""SSH host certificates (issue 28): deploybot's host certificate authority, loaded
from the environment (`authority`: sign a host key, the `@cert-authority` line people
put in known_hosts), and what a VM's certificate says (`certificates`: its principals,
its validity, read back for messages)."""
