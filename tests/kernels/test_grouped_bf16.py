"""m_grouped_bf16_gemm_nt_contiguous / _masked: argument checks and the CPU reference (CPU, CI), code
generation compiled for sm_90a (CPU, CI), and the JIT kernels against a float64 reference with the
MoE layouts' edge cases (GPU)."""

from __future__ import annotations

import re

import pytest
import torch

import kernels
from kernels.testing import calc_diff

from gemm_cases import H200_SMS
from grouped_cases import psum_layout, untouched_from
from test_sass import sass

_CONTIGUOUS, _MASKED = 1, 2


def make_weights(g: int, n: int, k: int, device: str) -> torch.Tensor:
    return torch.randn(g, n, k, device=device, dtype=torch.bfloat16)


def make_contiguous(counts: list[int], k: int, device: str, align: int = 128, padding_blocks: int = 0):
    """Rows of each group padded to ``align`` with -1, then ``padding_blocks`` blocks of -1 (a layout
    sized for more rows than came); returns (a [M, K] bf16, m_indices int32 [M])."""
    ids = []
    for g, c in enumerate(counts):
        ids += [g] * c + [-1] * ((c + align - 1) // align * align - c)
    ids += [-1] * (align * padding_blocks)
    m_indices = torch.tensor(ids, dtype=torch.int32, device=device)
    return torch.randn(len(ids), k, device=device, dtype=torch.bfloat16), m_indices


def run_contiguous(a, b, m_indices) -> torch.Tensor:
    """D of one contiguous call, poisoned with NaN before it."""
    d = torch.full((a.shape[0], b.shape[1]), float("nan"), dtype=torch.bfloat16, device=a.device)
    kernels.m_grouped_bf16_gemm_nt_contiguous(a, b, d, m_indices)
    return d


def run_masked(a, b, masked_m, expected_m: int) -> torch.Tensor:
    g, max_m, _ = a.shape
    d = torch.full((g, max_m, b.shape[1]), float("nan"), dtype=torch.bfloat16, device=a.device)
    kernels.m_grouped_bf16_gemm_nt_masked(a, b, d, masked_m, expected_m)
    return d


def assert_contiguous(d, a, b, m_indices, align: int = 128) -> None:
    """Rows of a group right against float64; aligned blocks of padding (first row -1) never written.
    Padding rows inside a group's last block may be computed (from whatever A holds there)."""
    for g in range(b.shape[0]):
        rows = m_indices == g
        if rows.any():
            got = d[rows]
            assert torch.isfinite(got).all(), f"group {g}: rows not fully written"
            assert calc_diff(got, a[rows].double() @ b[g].double().t()) < 1e-5, f"group {g}"
    padding_blocks = (m_indices[::align] < 0).repeat_interleave(align)[: m_indices.shape[0]]
    assert torch.isnan(d[padding_blocks]).all(), "padding blocks written"


def assert_masked(d, a, b, masked: list[int]) -> None:
    for g, count in enumerate(masked):
        count = max(0, min(count, a.shape[1]))
        if count:
            got = d[g, :count]
            assert torch.isfinite(got).all(), f"group {g}: rows not fully written"
            assert calc_diff(got, a[g, :count].double() @ b[g].double().t()) < 1e-5, f"group {g}"
        assert torch.isnan(d[g, untouched_from(count, d.device.type):]).all(), f"group {g}: rows past masked_m written"


def check_contiguous(counts, n, k, device, padding_blocks: int = 0):
    a, m_indices = make_contiguous(counts, k, device, padding_blocks=padding_blocks)
    b = make_weights(len(counts), n, k, device)
    assert_contiguous(run_contiguous(a, b, m_indices), a, b, m_indices)


def check_masked(masked, max_m, n, k, expected_m, device):
    g = len(masked)
    a = torch.randn(g, max_m, k, device=device, dtype=torch.bfloat16)
    b = make_weights(g, n, k, device)
    masked_m = torch.tensor(masked, dtype=torch.int32, device=device)
    assert_masked(run_masked(a, b, masked_m, expected_m), a, b, masked)


# ---- CPU ----------------------------------------------------------------------------------------

def test_cpu_contiguous(seed):
    check_contiguous([5, 0, 130, 1], 136, 192, "cpu", padding_blocks=2)


def test_cpu_masked(seed):
    check_masked([3, 0, 17, 40], 20, 64, 128, 8, "cpu")


@pytest.mark.parametrize("counts", [[5, 0, 130, 1], [0, 0, 3], [128, 129]])
def test_psum_layout_is_the_m_indices_layout(counts, seed):
    """use_psum_layout=True reads the same rows as m_indices (padding between groups and past the last
    left untouched)."""
    a, m_indices = make_contiguous(counts, 128, "cpu", padding_blocks=1)
    b = make_weights(len(counts), 64, 128, "cpu")
    psum = psum_layout(counts)
    assert torch.equal(kernels.grouped.psum_to_m_indices("t", psum, a.shape[0], len(counts), a.device), m_indices)
    d = torch.full((a.shape[0], 64), float("nan"), dtype=torch.bfloat16)
    kernels.m_grouped_bf16_gemm_nt_contiguous(a, b, d, psum, use_psum_layout=True, expected_m_for_psum_layout=64)
    assert_contiguous(d, a, b, m_indices)
    assert torch.isnan(d[m_indices < 0]).all()


def test_deepgemm_names():
    assert kernels.bf16_m_grouped_gemm_nt_masked is kernels.m_grouped_bf16_gemm_nt_masked
    assert kernels.fp8_m_grouped_gemm_nt_masked is kernels.m_grouped_fp8_gemm_nt_masked
    assert kernels.get_m_alignment_for_contiguous_layout is kernels.get_mk_alignment_for_contiguous_layout


def _contiguous_args(m=256, g=2, n=64, k=128):
    a, m_indices = make_contiguous([m // g] * g, k, "cpu")
    return dict(a=a, b=make_weights(g, n, k, "cpu"), d=torch.empty(a.shape[0], n, dtype=torch.bfloat16),
                grouped_layout=m_indices)


def _masked_args(g=3, max_m=16, n=64, k=128):
    return dict(a=torch.randn(g, max_m, k, dtype=torch.bfloat16), b=make_weights(g, n, k, "cpu"),
                d=torch.empty(g, max_m, n, dtype=torch.bfloat16),
                masked_m=torch.tensor([1] * g, dtype=torch.int32), expected_m=4)


def _bad(args: dict, **changes) -> dict:
    out = dict(args)
    for key, value in changes.items():
        out[key] = value(out[key]) if callable(value) else value
    return out


@pytest.mark.parametrize("change,kind,match", [
    (dict(a=lambda a: a.float()), TypeError, "a must be a 2-D bfloat16"),
    (dict(b=lambda b: b[0]), TypeError, "b must be a 3-D bfloat16"),
    (dict(a=lambda a: a.t().contiguous().t()), ValueError, "a must be K-major"),
    (dict(b=lambda b: b[:, :, :64]), ValueError, r"b must be K-major|b must have shape"),
    (dict(b=lambda b: b[:, :60].contiguous(), d=lambda d: d[:, :60]), ValueError, "N must be a positive multiple of 8"),
    (dict(b=lambda b: torch.empty(0, 64, 128, dtype=torch.bfloat16)), ValueError, "at least one group"),
    (dict(d=lambda d: d.float()), ValueError, "d must be a bfloat16 tensor"),
    (dict(d=lambda d: d[:-1]), ValueError, "d must be a bfloat16 tensor of shape"),
    (dict(grouped_layout=lambda t: t.long()), ValueError, "grouped_layout must be an int32"),
    (dict(grouped_layout=lambda t: t[:-1]), ValueError, "grouped_layout must be an int32"),
    (dict(use_psum_layout=True), ValueError, r"grouped_layout \(use_psum_layout=True\) must be a contiguous int32 "
                                             r"tensor \[2\] \(one row end per group\)"),
    (dict(use_psum_layout=True, grouped_layout=lambda t: t[:2].long()), ValueError, "contiguous int32 tensor"),
    (dict(expected_m_for_psum_layout=4), ValueError, "expected_m_for_psum_layout must be None"),
    (dict(use_psum_layout=1), TypeError, "use_psum_layout must be a bool"),
    (dict(ensure_zero_padding=1), TypeError, "ensure_zero_padding must be a bool"),
    (dict(compiled_dims=3), ValueError, "compiled_dims"),
    (dict(b=lambda b: torch.randn(2, 64, 128, device="meta", dtype=torch.bfloat16)), ValueError, "one device"),
])
def test_contiguous_refuses_bad_arguments(change, kind, match):
    with pytest.raises(kind, match=f"m_grouped_bf16_gemm_nt_contiguous: .*({match})"):
        kernels.m_grouped_bf16_gemm_nt_contiguous(**_bad(_contiguous_args(), **change))


def test_contiguous_refuses_k_off_64():
    args = _contiguous_args(k=96)
    with pytest.raises(ValueError, match="K of 64"):
        kernels.m_grouped_bf16_gemm_nt_contiguous(**args)


@pytest.mark.parametrize("change,kind,match", [
    (dict(expected_m=0), ValueError, "expected_m must be a positive int"),
    (dict(expected_m=True), ValueError, "expected_m must be a positive int"),
    (dict(a=lambda a: a[0]), TypeError, "a must be a 3-D bfloat16"),
    (dict(a=lambda a: a[:2]), ValueError, "a has 2 groups but b has 3"),
    (dict(a=lambda a: torch.randn(3, 20, 128, dtype=torch.bfloat16)[:, :16]), ValueError, "stack its groups"),
    (dict(d=lambda d: torch.empty(3, 20, 64, dtype=torch.bfloat16)[:, :16]), ValueError, "groups without gaps"),
    (dict(b=lambda b: torch.randn(3, 70, 128, dtype=torch.bfloat16)[:, :64]), ValueError, "stack its groups"),
    (dict(masked_m=lambda t: t[:2]), ValueError, "masked_m must be an int32 tensor of shape"),
    (dict(masked_m=lambda t: t.float()), ValueError, "masked_m must be an int32"),
])
def test_masked_refuses_bad_arguments(change, kind, match):
    with pytest.raises(kind, match=f"m_grouped_bf16_gemm_nt_masked: .*({match})"):
        kernels.m_grouped_bf16_gemm_nt_masked(**_bad(_masked_args(), **change))


def test_masked_counts_are_clamped_on_cpu(seed):
    """Counts outside [0, max_m] write nothing past the group (the GPU clamps them the same way)."""
    check_masked([-3, 25, 7], 16, 64, 128, 8, "cpu")


@pytest.mark.parametrize("gemm_type,m,groups,n,k", [
    (_CONTIGUOUS, 8192, 4, 4096, 7168),
    (_CONTIGUOUS, 1000, 32, 7168, 2048),
    (_MASKED, 16, 256, 4096, 7168),
    (_MASKED, 256, 32, 7168, 2048),
    (_MASKED, 1, 8, 576, 192),
])
def test_grouped_bf16_compiles_for_sm90a(gemm_type, m, groups, n, k):
    """HGMMA from shared memory, TMA loads and stores, register budgets set, nothing spilled; masked
    kernels store through a 3-D map (the group is a coordinate)."""
    native = kernels.jit.native_module()
    name, code = native.bf16_gemm_nt_code(m, n, k, H200_SMS, gemm_type=gemm_type, num_groups=groups)
    assert f", {gemm_type}>" in code
    s = sass(name, code)
    for op in ("HGMMA", "UTMALDG", "UTMASTG", "USETMAXREG"):
        assert op in s, op
    assert not re.search(r"\b(LDL|STL)\b", s), "spills"
    if gemm_type == _MASKED:
        assert "UTMASTG.3D" in s


def test_masked_plan_follows_expected_m():
    """expected_m steers the tiles (few rows per group: 64-row tiles), the group count multiplies the work."""
    native = kernels.jit.native_module()
    few = native.bf16_gemm_nt_config(8, 4096, 7168, H200_SMS, gemm_type=_MASKED, num_groups=32)
    many = native.bf16_gemm_nt_config(1024, 4096, 7168, H200_SMS, gemm_type=_MASKED, num_groups=32)
    assert (few["block_m"], many["block_m"]) == (64, 128)
    with pytest.raises(RuntimeError, match="num_groups must be >= 1"):
        native.bf16_gemm_nt_config(8, 4096, 7168, H200_SMS, gemm_type=_MASKED, num_groups=0)


def test_precompile_lists_the_bf16_families():
    from kernels.precompile import collect_sources

    for family, label in (("m_grouped_bf16_gemm_nt_contiguous", "m<="), ("m_grouped_bf16_gemm_nt_masked",
                                                                         "expected_m=")):
        sources = collect_sources([family], max_m=256)
        assert sources and all(s.family == family and label in s.label for s in sources)
        assert {s.name for s in sources} == {"sm90_bf16_gemm_nt"}


# ---- GPU ----------------------------------------------------------------------------------------

CONTIGUOUS_COUNTS = [
    [3000, 0, 129, 1, 0, 700],       # empty groups, tails
    [0, 0, 1000, 0],                 # all tokens in one group
    [1],                             # G = 1
    [4096] * 4,                      # prefill, 4 experts
]
MASKED_CASES = [
    ([20] * 32, 32, 20),                          # decode, 32 experts
    ([0, 5, 100, 0, 77, 1, 128, 3], 128, 8),       # zero groups, expected far below
    ([0] * 16, 64, 64),                           # nothing to do
    ([70, 3, 100], 100, 600),                     # max_m not a multiple of the block, expected far above
    ([37], 50, 4),                                # G = 1 (D's map stays 3-D)
    ([-5, 300, 9], 64, 16),                       # counts outside [0, max_m] clamped
    ([200, 129, 0, 256], 256, 256),               # 128-row tiles (two math warpgroups, 16 boxes per atom)
]


@pytest.mark.gpu
@pytest.mark.parametrize("counts", CONTIGUOUS_COUNTS)
@pytest.mark.parametrize("n,k", [(4096, 7168), (7168, 2048), (200, 192)])
def test_gpu_contiguous(counts, n, k, seed):
    check_contiguous(counts, n, k, "cuda", padding_blocks=3)


@pytest.mark.gpu
@pytest.mark.parametrize("masked,max_m,expected_m", MASKED_CASES)
@pytest.mark.parametrize("n,k", [(4096, 7168), (7168, 2048), (200, 192)])
def test_gpu_masked(masked, max_m, expected_m, n, k, seed):
    check_masked(masked, max_m, n, k, expected_m, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("masked", [False, True])
def test_gpu_row_strides_wider_than_the_rows(masked, seed):
    """A, B and D read and written through their row strides (K + 64 and N + 24 elements), groups stacked:
    the columns of D from N to its row stride stay untouched."""
    g, n, k = 3, 200, 320
    b = torch.randn(g, n, k + 64, device="cuda", dtype=torch.bfloat16)[:, :, :k]
    if masked:
        counts, max_m = [77, 0, 130], 136
        a = torch.randn(g, max_m, k + 64, device="cuda", dtype=torch.bfloat16)[:, :, :k]
        wide = torch.full((g, max_m, n + 24), float("nan"), device="cuda", dtype=torch.bfloat16)
        kernels.m_grouped_bf16_gemm_nt_masked(a, b, wide[:, :, :n], torch.tensor(counts, dtype=torch.int32,
                                                                                  device="cuda"), 64)
        assert_masked(wide[:, :, :n], a, b, counts)
    else:
        a_rows, m_indices = make_contiguous([300, 0, 5], k, "cuda", padding_blocks=1)
        a = torch.randn(a_rows.shape[0], k + 64, device="cuda", dtype=torch.bfloat16)[:, :k]
        wide = torch.full((a.shape[0], n + 24), float("nan"), device="cuda", dtype=torch.bfloat16)
        kernels.m_grouped_bf16_gemm_nt_contiguous(a, b, wide[:, :n], m_indices)
        assert_contiguous(wide[:, :n], a, b, m_indices)
    assert torch.isnan(wide[..., n:]).all(), "columns past N written"


@pytest.mark.gpu
def test_gpu_psum_layout(seed):
    counts = [3000, 0, 129, 1, 0, 700]
    a, m_indices = make_contiguous(counts, 512, "cuda", padding_blocks=2)
    b = make_weights(len(counts), 256, 512, "cuda")
    d = torch.full((a.shape[0], 256), float("nan"), device="cuda", dtype=torch.bfloat16)
    kernels.m_grouped_bf16_gemm_nt_contiguous(a, b, d, psum_layout(counts).cuda(), use_psum_layout=True)
    assert_contiguous(d, a, b, m_indices)
    assert torch.equal(d.nan_to_num(), run_contiguous(a, b, m_indices).nan_to_num())


@pytest.mark.gpu
def test_gpu_masked_256_groups(seed):
    check_masked([(i * 7) % 13 for i in range(256)], 16, 256, 512, 4, "cuda")


@pytest.mark.gpu
def test_gpu_contiguous_bad_group_ids_are_skipped(seed):
    """Blocks whose id lies outside [0, G) are not computed (nor read past B)."""
    a, m_indices = make_contiguous([128, 128, 128], 256, "cuda")
    m_indices[128:256] = 7
    b = make_weights(3, 64, 256, "cuda")
    d = run_contiguous(a, b, m_indices)
    assert torch.isnan(d[128:256]).all()
    m_indices[128:256] = -1
    assert_contiguous(d, a, b, m_indices)


@pytest.mark.gpu
def test_gpu_masked_in_a_cuda_graph(seed):
    """masked_m is read on the device: a captured call follows the counts of each replay."""
    g, max_m, n, k = 8, 64, 512, 1024
    a = torch.randn(g, max_m, k, device="cuda", dtype=torch.bfloat16)
    b = make_weights(g, n, k, "cuda")
    masked_m = torch.zeros(g, dtype=torch.int32, device="cuda")
    d = torch.empty(g, max_m, n, device="cuda", dtype=torch.bfloat16)
    kernels.m_grouped_bf16_gemm_nt_masked(a, b, d, masked_m, 16)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernels.m_grouped_bf16_gemm_nt_masked(a, b, d, masked_m, 16)
    for counts in ([3, 0, 64, 17, 1, 0, 40, 9], [64] * 8):
        d.fill_(float("nan"))
        masked_m.copy_(torch.tensor(counts, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        assert_masked(d, a, b, counts)
