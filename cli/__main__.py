"""``python -m shmrpc.cli ...`` is the ``shmrpc`` command."""

from __future__ import annotations

import sys

from . import main

sys.exit(main())
