"""Makes the package importable from a checkout (python/ on sys.path) unless it is installed."""

import importlib.util
import pathlib
import sys

if importlib.util.find_spec("mla_decode") is None:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
