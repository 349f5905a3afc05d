"""Configuration: the TOML file and the environment's secrets, read and checked into
settings models once at start (`settings`), and the core's own sections (`sections`).
The example configuration ships here."""
