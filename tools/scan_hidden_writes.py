"""Find ATen operators that write arguments their schema does not mark ``(a!)``.

The Fake layer learns what an operator writes from its schema
(``fake/opinfo.py``).  A few legacy kernels write more than their schema
says (``native_batch_norm`` updates ``running_mean``/``running_var`` in
training mode).  This script finds them empirically: it runs every sample
input of PyTorch's own operator and module test databases
(``torch.testing._internal``: ``op_db`` and ``module_db``, training and
eval mode) on real CPU tensors under a dispatch mode that, for every ATen
call that reaches it (after composite decompositions, the level the Fake
layer sees), compares each tensor argument's bytes before and after, and
reports the arguments that changed without a write annotation.

Usage (needs the ``expecttest`` package that ``torch.testing._internal``
imports)::

    python tools/scan_hidden_writes.py            # op_db + module_db, CPU
    python tools/scan_hidden_writes.py --limit 50 # a quick partial run

The result is compared with ``deferinit.fake.opinfo.HIDDEN_WRITES``; anything new is
printed as a line to add there.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from deferinit.fake.opinfo import HIDDEN_WRITES, op_info  # noqa: E402


def _snapshot(t):
    if type(t) is not torch.Tensor or t.layout is not torch.strided or t.is_quantized or t.is_meta:
        return None
    with torch.no_grad():
        return t.detach().clone().contiguous().reshape(-1).view(torch.uint8).clone()


def _changed(t, before) -> bool:
    with torch.no_grad():
        now = t.detach().contiguous().reshape(-1).view(torch.uint8)
    return not torch.equal(now, before)


class Scan(TorchDispatchMode):
    """Records (overload, argument name) pairs written without a schema annotation."""

    def __init__(self):
        super().__init__()
        self.found = collections.defaultdict(set)
        self.seen = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.seen[func] += 1
        schema = func._schema
        info = op_info(func)
        declared = {i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write}
        if info.hidden is not None and info.hidden[1](args, kwargs):
            declared.update(info.hidden[0])
        watched = []
        for i, a in enumerate(schema.arguments):
            if i in declared:
                continue
            if i < len(args) and not a.kwarg_only:
                value = args[i]
            else:
                value = kwargs.get(a.name)
            flat = value if isinstance(value, (list, tuple)) else [value]
            for t in flat:
                if isinstance(t, torch.Tensor):
                    before = _snapshot(t)
                    if before is not None:
                        watched.append((i, a.name, t, before))
        out = func(*args, **kwargs)
        for i, name, t, before in watched:
            if _changed(t, before):
                self.found[func].add(name)
        return out


def _run_op_db(scan, limit):
    from torch.testing._internal.common_methods_invocations import op_db

    dtypes = (torch.float32, torch.float64, torch.int64, torch.bool)
    for op in op_db[:limit]:
        for dtype in dtypes:
            if dtype not in op.supported_dtypes("cpu"):
                continue
            try:
                samples = list(op.sample_inputs("cpu", dtype, requires_grad=False))
            except Exception:
                continue
            for s in samples:
                for fn in filter(None, (op.op, op.get_inplace())):
                    try:
                        inp = s.input.clone() if isinstance(s.input, torch.Tensor) else s.input
                        with scan:
                            fn(inp, *s.args, **s.kwargs)
                    except Exception:
                        pass
            break


def _run_module_db(scan, limit):
    from torch.testing._internal.common_modules import module_db

    for info in module_db[:limit]:
        try:
            inputs = info.module_inputs_func(info, device="cpu", dtype=torch.float32, requires_grad=False, training=True)
        except Exception:
            continue
        for mi in inputs:
            if mi.forward_input is None:
                continue
            for training in (True, False):
                try:
                    m = info.module_cls(*mi.constructor_input.args, **mi.constructor_input.kwargs)
                    m.train(training)
                    with scan:
                        m(*mi.forward_input.args, **mi.forward_input.kwargs)
                except Exception:
                    pass


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=None, help="scan only the first N entries of each database")
    ns = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    scan = Scan()
    _run_op_db(scan, ns.limit)
    _run_module_db(scan, ns.limit)
    print(f"{len(scan.seen)} ATen overloads exercised, {sum(scan.seen.values())} calls")
    for func in sorted(HIDDEN_WRITES, key=str):
        names = [func._schema.arguments[i].name for i in HIDDEN_WRITES[func][0]]
        status = "exercised" if scan.seen[func] else "not exercised by the databases"
        print(f"known   {func}: {', '.join(names)} ({status})")
    new = 0
    for func, names in sorted(scan.found.items(), key=lambda kv: str(kv[0])):
        print(f"HIDDEN  {func}: {', '.join(sorted(names))}")
        new += 1
    print(f"{new} overload(s) write arguments that neither the schema nor HIDDEN_WRITES declares")
    return 1 if new else 0


if __name__ == "__main__":
    sys.exit(main())
