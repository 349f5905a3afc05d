"""What chat hears from the core: commands kept from acknowledgement until answered
(`inbox`) and the notices a person must still be told (`outbox`)."""
