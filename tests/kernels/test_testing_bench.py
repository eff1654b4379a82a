"""kernels.testing.bench helpers that need no GPU: the benchmarks' --variant parsing and the
environment switches they time variants under."""

import os

import pytest

from kernels.testing import env_switches, parse_env_variants


def test_parse_env_variants_pairs_and_labels():
    assert parse_env_variants([]) == []
    assert parse_env_variants(["MOE_GEMM_BLOCK_N=192", "A=1,B=x=y"]) == [
        ("MOE_GEMM_BLOCK_N=192", {"MOE_GEMM_BLOCK_N": "192"}), ("A=1,B=x=y", {"A": "1", "B": "x=y"})]


@pytest.mark.parametrize("bad", ["MOE_GEMM_BLOCK_N", "=1", "A=1,", "A=1,B"])
def test_parse_env_variants_rejects_malformed(bad):
    with pytest.raises(ValueError, match="NAME=VALUE"):
        parse_env_variants([bad])


def test_env_switches_restore(monkeypatch):
    monkeypatch.setenv("MOE_TEST_SWITCH_SET", "before")
    monkeypatch.delenv("MOE_TEST_SWITCH_UNSET", raising=False)
    with env_switches(MOE_TEST_SWITCH_SET="inside", MOE_TEST_SWITCH_UNSET="1"):
        assert os.environ["MOE_TEST_SWITCH_SET"] == "inside" and os.environ["MOE_TEST_SWITCH_UNSET"] == "1"
    assert os.environ["MOE_TEST_SWITCH_SET"] == "before" and "MOE_TEST_SWITCH_UNSET" not in os.environ
