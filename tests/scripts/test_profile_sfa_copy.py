"""scripts/profile_sfa_copy.py: how it splits a profile's kernels into calls (a copy and the GEMM
behind it, or a GEMM alone), on hand-made kernels."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "profile_sfa_copy.py"
_spec = importlib.util.spec_from_file_location("profile_sfa_copy", _PATH)
profile_sfa_copy = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(profile_sfa_copy)


def _event(name: str, start: float, end: float):
    """A kernel as the profile gives it: (name, start µs, duration µs)."""
    return name, start, end - start


def test_split_pairs_a_copy_with_the_gemm_behind_it():
    events = [_event("mn_major_sf_kernel", 0.0, 6.0), _event("sm90_fp8_gemm_nt<...>", 5.0, 105.0),
              _event("sm90_fp8_gemm_nt<...>", 200.0, 290.0),
              _event("mn_major_sf_kernel", 400.0, 403.0), _event("sm90_fp8_gemm_nt<...>", 404.0, 500.0)]
    assert profile_sfa_copy.split(events) == [(6.0, 5.0, 100.0, 105.0), (0.0, 0.0, 90.0, 90.0),
                                              (3.0, 4.0, 96.0, 100.0)]


def test_split_counts_a_copy_without_a_gemm_as_a_call_of_its_own():
    assert profile_sfa_copy.split([_event("mn_major_sf_kernel", 0.0, 6.0)]) == [(0.0, 0.0, 6.0, 6.0)]


def test_variants_are_named_once_and_switch_only_the_copy():
    labels = [label for label, _, _ in profile_sfa_copy.VARIANTS]
    assert len(labels) == len(set(labels))
    assert all(set(env) <= {"MOE_FP8_SFA_COPY", "MOE_GEMM_PDL"}
               for _, _, env in profile_sfa_copy.VARIANTS)
