"""Federation: daemons that know their peers (membership, cluster view, multi-host reservations)."""
