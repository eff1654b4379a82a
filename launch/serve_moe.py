"""Serve the MoE layers of a model across torchrun ranks (expert parallelism).

    torchrun --standalone --nproc-per-node 2 launch/serve_moe.py            # embedded small config, CPU is fine
    torchrun --nproc-per-node 8 launch/serve_moe.py --preset deepseek-v3    # 256 experts, top-8, on GPUs
    torchrun --nproc-per-node 8 launch/serve_moe.py --checkpoint DIR --metrics-out m.json

``--help`` lists every option. SIGINT/SIGTERM stop all ranks at the next batch boundary and the
metrics gathered so far are still written.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moe_runtime.serving.cli import main  # noqa: E402

if __name__ == "__main__":
    code = main()
    # The process groups are torn down by now (or a rank failed). Leave without interpreter
    # teardown: gloo's worker threads can abort a rank at exit ("terminate called without an
    # active exception", a known PyTorch issue), which would turn a clean run into a failure.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
