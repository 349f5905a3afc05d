"""Scripts the tests start as separate processes: `python -m tests.support.workers.NAME`."""
