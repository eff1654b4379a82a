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


def test_checked_variant_us_checks_the_variants_own_output(monkeypatch):
    """The output is poisoned before the variant's call, so a variant that writes nothing shows
    (NaN), and the call sees the switch; the environment comes back afterwards."""
    import torch

    import kernels.testing.bench as bench_helpers

    monkeypatch.delenv("MOE_TEST_VARIANT", raising=False)
    monkeypatch.setattr(bench_helpers, "bench_kineto",
                        lambda fn, name: (fn(), bench_helpers.KernelTiming(3e-6, 1e-6, 1, 1))[1])
    out = torch.zeros(4)
    writes = lambda: out.fill_(float(os.environ.get("MOE_TEST_VARIANT") == "1"))  # noqa: E731
    us, diff = bench_helpers.checked_variant_us(writes, "k", out, lambda o: float(o.sum()), MOE_TEST_VARIANT="1")
    assert us == pytest.approx(3.0) and diff == 4.0 and "MOE_TEST_VARIANT" not in os.environ
    _, diff = bench_helpers.checked_variant_us(lambda: None, "k", out, lambda o: float(o.sum()), MOE_TEST_VARIANT="1")
    assert diff != diff  # NaN: nothing was written
