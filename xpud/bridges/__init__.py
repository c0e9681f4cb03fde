"""Bridges to the schedulers sites already run (Slurm, Kubernetes): clients of the same engine as
`xpu run`, so pods, batch jobs and direct users share one ledger."""
