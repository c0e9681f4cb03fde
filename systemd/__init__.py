"""Package data: the systemd unit and the sysusers.d entry that ``xpud install-service`` writes."""
