"""The composition root and the ways in: `compose` builds every core service once,
`Deployer` is the front door front ends call, `runtime` opens backends and the store,
`cli` is the `deploybot` command line, `queries` the read-only questions front ends ask."""
