"""Regenerate the pictures in docs/img/ from the current code.

    python docs/make_images.py

Needs Graphviz's `dot` program (apt-get install graphviz).  Each picture is
`deferinit.to_dot` of a deferred module, written as SVG.
"""

import pathlib
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deferinit import deferred_init, to_dot  # noqa: E402
from deferinit.demo import LLAMA_70B, Llama  # noqa: E402
from deferinit.dot import write  # noqa: E402

IMG = ROOT / "docs" / "img"


def main() -> None:
    IMG.mkdir(parents=True, exist_ok=True)
    pictures = {
        # normal_ on the weight, then a view of row 0 filled in place.
        "embedding.svg": lambda: to_dot(deferred_init(torch.nn.Embedding, 10, 4, padding_idx=0)),
        # BatchNorm: buffers, constants and in-place fills.
        "batchnorm.svg": lambda: to_dot(deferred_init(torch.nn.BatchNorm1d, 16)),
        # The demo's 70B Llama: 80 identical layers drawn once (x80).
        "llama70b.svg": lambda: to_dot(deferred_init(Llama, LLAMA_70B, dtype=torch.bfloat16)),
        # The same model folded two levels down.
        "llama70b-depth2.svg": lambda: to_dot(deferred_init(Llama, LLAMA_70B, dtype=torch.bfloat16), depth=2),
    }
    for name, make in pictures.items():
        t0 = time.perf_counter()
        path = write(make(), IMG / name)
        print(f"wrote {path.relative_to(ROOT)} in {time.perf_counter() - t0:.2f} s")


if __name__ == "__main__":
    main()
