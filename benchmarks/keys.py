"""A public key for the benchmarks' deploys: a deploy with no key is refused (nobody
could log in), and a public key is no secret."""

BENCH_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHb2vLw3m3tqB7m4m1Lr2x9n0l3r3x8uGk2ycJ0b1Fq8 test"
