"""Faults on real links: bootstrap, prefill, decode and router in separate network
namespaces (or behind loopback TCP fault proxies where namespaces cannot be made), an
abort storm, and one fault at a time. `python -m bench.netfaults --help`."""
