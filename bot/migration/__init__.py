"""Leaving a hypervisor (issue 30): the read-only migration plan. Which source to read
and how (`sources`: a vSphere backend through its read-only session, an OVA by its
head), what each template of it becomes on the target (`classify`: rebuilt from a build
profile, already there, or not mappable, with the reason), what each VM would take
(`vms`: moves as is, needs decisions, or blocked, with what does not travel) and the
plan itself with the digest of the source facts it read and its file (`plan`).
Templates are rebuilt from their profiles, never imported; VMs are planned, not moved.
"""
