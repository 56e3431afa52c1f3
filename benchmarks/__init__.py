"""The benchmarks: scripts run as `python benchmarks/<name>.py` (see the READMEs here).  A package so that
one benchmark can import another and the import contracts in pyproject.toml can name it."""
