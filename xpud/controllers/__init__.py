"""Loops that watch the engine and act through its public API: health, defragmenter, rightsizer,
provisioner."""
