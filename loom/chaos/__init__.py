"""`loom chaos`: scenarios of misbehaving clients against a running server, and the invariants
checked after each."""
