"""A real NetBox for the tests: installed once (install), served on 127.0.0.1 (server),
the fixture (harness)."""
