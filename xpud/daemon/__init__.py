"""The daemon process: its command line, the parts it builds, periodic jobs, metrics, reload, doctor,
install."""
