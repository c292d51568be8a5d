"""Slow tier: real peer processes, network namespaces, the DHT's daemons; marked `integration` by
tests/conftest.py."""
