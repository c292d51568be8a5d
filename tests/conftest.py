"""The two tiers and the shared helpers.

tests/unit holds tests that run in this one process; tests/integration holds tests that start real
peer processes, network namespaces or the DHT's daemons. Every test under tests/integration gets the
`integration` marker here, so `pytest -m "not integration"` is the fast tier and `pytest` runs both.
The helpers (golden.py, children.py, fixtures/) stay in tests/ and are imported as top-level modules
(`from golden import ...`) from either tier."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
INTEGRATION = TESTS / "integration"

if str(TESTS) not in sys.path:  # pytest's default import mode puts it there too; not every mode does
    sys.path.insert(0, str(TESTS))


def pytest_collection_modifyitems(config, items):
    for item in items:
        if INTEGRATION in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.integration)
