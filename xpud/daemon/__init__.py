"""The daemon process: the parts it builds in order (``app``), its command line (``cli``), systemd
notify, periodic jobs, metrics, reload, doctor, install."""
