"""VM leases: every VM gets an end; lengths as people write them (`terms`), reminders
before the end, power-off at it and destroy after (`enforce`)."""
