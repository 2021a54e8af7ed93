"""`manta bench` and the soak: benchmarks that print a table and write JSON."""
