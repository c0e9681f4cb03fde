"""The scheduler's state machine and its parts (moves, standby slices, the wait queue)."""
