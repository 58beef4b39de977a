"""The suite's random seed: fixed by default, so a run repeats; ``SHMRPC_TEST_SEED=<n>`` to try another.

Every test that draws random numbers derives them from :data:`SEED` (plus a per-test offset), and
Hypothesis runs with it too (tests/conftest.py passes it as ``--hypothesis-seed`` unless that is
given). A failing test's report shows the seed it ran with.
"""

from __future__ import annotations

import os

__all__ = ["DEFAULT_SEED", "ENV", "SEED"]

ENV = "SHMRPC_TEST_SEED"
DEFAULT_SEED = 20261130
SEED = int(os.environ.get(ENV, DEFAULT_SEED))
