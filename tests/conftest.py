"""Test setup shared by every test module.

Eight fake CPU devices are requested before JAX initialises so that multi-device tests (a `data`
mesh of 8) run on any laptop; single-device tests are unaffected (they use device 0).
"""

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pathlib  # noqa: E402

import pytest  # noqa: E402

SHARED_DATA = pathlib.Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data():
    """The real QA data in ../shared/data; skips with the reason when a clone has none."""
    if not SHARED_DATA.is_dir():
        pytest.skip(
            reason=f"real QA data not found at {SHARED_DATA} (only present beside the project)"
        )
    return SHARED_DATA
