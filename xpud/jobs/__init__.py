"""Detached jobs: the daemon\x27s book of them and the per-job supervisor that outlives the daemon."""
