"""Suite-wide settings; see pdmesh/cli.py for why OpenMP must not busy-wait here."""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
