"""The durable state: the SQLite ledger and its typed operations."""
