"""Real QEMU guests for tests (issue 16): a Debian image, a NoCloud seed, a runner."""
