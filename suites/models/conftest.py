"""Fixtures shared by the model suites."""
import pytest


@pytest.fixture
def nightly_only(request):
    if request.config.getoption("profile") != "nightly":
        pytest.skip("deep model-parity variant runs only under --profile nightly (CI time budget)")
