"""Per-user settings: saved SSH keys, a default template, and the references front ends
keep for a person."""
