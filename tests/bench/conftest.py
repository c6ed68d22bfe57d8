"""bench/ is run from the repository (`python -m bench.run`), not installed: make it importable under any pytest."""

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
