import os
from pathlib import Path

import pytest

from qevolve.data.install import is_installed, install
from qevolve.paths import shared_data_dir


@pytest.fixture(scope="session")
def alfworld_installed():
    """The real ALFWorld games, installed from ../shared/data into the data directory once."""
    if not is_installed("alfworld"):
        if shared_data_dir() is None:
            pytest.fail("ALFWorld data is not installed and ../shared/data is missing: run `qevolve data install alfworld`")
        install(["alfworld"])
    return True
