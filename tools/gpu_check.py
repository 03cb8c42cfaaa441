"""``make gpu-check``: what only a GPU can check, in one command.

On a machine with CUDA it runs the CUDA-only tests (``tests/gpu``: real
transformers, diffusers, timm and torch.nn models materialized on ``cuda``
equal to eager construction on ``cuda``, in two orders, generators after;
a record made for ``cuda`` materialized there; FSDP2 on two NCCL ranks
where two GPUs exist) and the GPU benchmark (``benchmarks/gpu_replay.py``),
whose table it writes into docs/benchmarks.md under "On a GPU".  Without
CUDA it says that it skipped and exits 0.
"""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs", "benchmarks.md")


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}, but no device"
        print(f"gpu-check: skipped: no CUDA device (torch {torch.__version__}, {build}); "
              "CUDA is exercised through fakes by make test.")
        return 0
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/gpu"], cwd=ROOT, env=env)
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import gpu_replay

    table = gpu_replay.main()
    print(table)
    gpu_replay.write_section(DOCS, table)
    print(f"wrote the GPU section of {DOCS}")
    return tests.returncode


if __name__ == "__main__":
    sys.exit(main())
