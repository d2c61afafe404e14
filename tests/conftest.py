"""Shared fixtures. Compiles are cached per session in one temporary cache directory so
the export/SASS tests pay each compile once."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device")
    config._cutekern_results = []


def pytest_runtest_logreport(report):
    # selftest report: one row per test (call phase, or a setup failure/skip)
    if report.when == "call" or report.outcome != "passed":
        cfg = _CONFIG.get("config")
        if cfg is not None:
            cfg._cutekern_results.append({"test": report.nodeid, "when": report.when,
                                          "outcome": report.outcome,
                                          "seconds": round(report.duration, 3),
                                          "message": str(report.longrepr)[-2000:] if report.failed else ""})


_CONFIG: dict = {}


def pytest_sessionstart(session):
    _CONFIG["config"] = session.config


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("CUTEKERN_REPORT")
    if not path:
        return
    rows = session.config._cutekern_results
    info = {}
    try:
        import torch
        info = {"torch": torch.__version__,
                "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                "driver": torch.version.cuda}
    except Exception:  # the report must be written whatever happened
        pass
    summary = {k: sum(r["outcome"] == k for r in rows if r["when"] == "call" or k != "passed")
               for k in ("passed", "failed", "skipped")}
    Path(path).write_text(json.dumps({
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "artifacts": os.environ.get("CUTEKERN_ARTIFACTS"), "exitstatus": int(exitstatus),
        **info, "summary": summary, "tests": rows}, indent=1))


@pytest.fixture(scope="session")
def session_cache(tmp_path_factory):
    """One compile cache for the whole session (unless CUTEKERN_CACHE_DIR is set)."""
    if "CUTEKERN_CACHE_DIR" not in os.environ:
        os.environ["CUTEKERN_CACHE_DIR"] = str(tmp_path_factory.mktemp("cutekern-cache"))
    return Path(os.environ["CUTEKERN_CACHE_DIR"])
