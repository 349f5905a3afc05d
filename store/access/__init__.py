"""The parts of `Store` (store/db.py), one mixin per table or concern; `Store` is the one
public class, so import it from store.db, not these."""
