"""Helpers shared by the test modules (conftest.py is not importable by name: there are two)."""
import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def dsl_installed() -> bool:
    return importlib.util.find_spec("cutlass") is not None
