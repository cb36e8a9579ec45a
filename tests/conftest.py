"""Under scripts/test's two pytest-xdist workers (PYTEST_XDIST_WORKER set), torch computes on one thread in each
worker: two workers on the 2-core machine, each of torch's default two threads, oversubscribe it beside a launch's
ranks (which run one thread each, tests/mp.py), and timed checks then measure the oversubscription (an 8x matrix
product measured 1.18x its reference once)."""
from __future__ import annotations

import os

import torch


def pytest_configure() -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)
