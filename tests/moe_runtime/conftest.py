"""Fixtures shared by the moe_runtime tests."""

import pytest

from kernels.testing.numeric import calc_diff as _calc_diff


@pytest.fixture
def calc_diff():
    return _calc_diff
