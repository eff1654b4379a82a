"""bench/bench_host_launch.py on this machine (it needs no GPU: the host-only driver): every row's
raw entry point takes the arguments the bench passes (a signature change in csrc/apis must reach
it) and reports a time and the descriptors it encodes."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from kernels.testing.host_driver import build_host_driver

_BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_host_launch.py"


def test_every_row_runs_under_the_host_driver(tmp_path):
    try:  # the bench builds the host-only driver too: without a C++ compiler neither can run
        build_host_driver(tmp_path)
    except RuntimeError as error:
        if "no C++ compiler" in str(error):
            pytest.skip(str(error))
        raise
    proc = subprocess.run([sys.executable, str(_BENCH), "--iters", "3"], capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if re.match(r"\| (fp8_gemm_nt|m_grouped)", line)]
    assert len(rows) == 6, proc.stdout
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        us, us_no_memo, encodes, encodes_no_memo = float(cells[1]), float(cells[2]), int(cells[3]), int(cells[4])
        assert us > 0 and us_no_memo > 0, row
        # The descriptor memo: repeats encode nothing; without it every map is encoded again.
        assert encodes == 0 and encodes_no_memo >= 3, row
