"""Checks checkpoint mutants against the reference loaders, in a child process.

Run by tests/materialize/test_checkpoint_fuzz.py, which writes the mutants
(corrupted safetensors files, ``torch.save`` archives, folders with an
index) and a job file: one JSON line per mutant, ``{"i", "kind", "path",
"strict"}``.  For each mutant this process prints ``start <i>`` (flushed)
before touching it, then one JSON line with the outcome, so that a crash of
the process (a signal) names the mutant that caused it.

The rule checked for every mutant, on a deferred module (``load_checkpoint``
then ``materialize_module``) and on a real one:

* the reference loads it (``safetensors.torch.load_file``, or
  ``torch.load(map_location="cpu", weights_only=True)``, or for a folder each
  file its index names, read that way), and ``load_state_dict`` takes it:
  then ``load_checkpoint`` gives the same values, bit for bit (and the same
  missing and unexpected keys), or raises ``CheckpointError``;
* otherwise ``load_checkpoint`` raises ``CheckpointError``;
* never another exception, never an error while materializing, and after a
  ``CheckpointError`` the module is exactly as it was (record and values).

A distributed checkpoint (kind ``dcp``) is checked against ``dcp.load`` into
the eager module (:func:`check_dcp`).

Reproduce one mutant: ``python tests/checkpoint_fuzz_worker.py --one KIND PATH``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

SEED = 5


class Holder(nn.Module):
    """Parameters and buffers of several dtypes and ranks (a 0-dim one too)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 4)
        self.norm = nn.LayerNorm(4)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        self.register_buffer("mask", torch.zeros(2, 3, dtype=torch.bool))
        self.register_buffer("h16", torch.ones(5, dtype=torch.float16))
        self.register_buffer("cplx", torch.zeros(2, dtype=torch.complex64))
        self.register_buffer("wide", torch.ones(2, 2, dtype=torch.float64))


def build() -> nn.Module:
    return Holder()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _same(a: dict, b: dict) -> str | None:
    if list(a) != list(b):
        return f"keys {list(a)} != {list(b)}"
    for k in a:
        x, y = a[k], b[k]
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(_bits(x), _bits(y)):
            return f"{k}: {x.dtype} {list(x.shape)} {x.flatten()[:6].tolist()} != {y.dtype} {list(y.shape)} {y.flatten()[:6].tolist()}"
    return None


def _read(path: str) -> dict:
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    return torch.load(path, map_location="cpu", weights_only=True)


def reference(kind: str, path: str):
    """What the reference loader gives (a state dict), or the exception it raises."""
    try:
        if kind != "index":
            return _read(path)
        names = [n for n in ("model.safetensors.index.json", "pytorch_model.bin.index.json") if os.path.exists(os.path.join(path, n))]
        with open(os.path.join(path, names[0])) as f:
            weight_map = json.load(f)["weight_map"]
        files, sd = {}, {}
        for key, name in weight_map.items():
            if name not in files:
                files[name] = _read(os.path.join(path, name))
            sd[key] = files[name][key]
        return sd
    except Exception as e:  # noqa: BLE001 - whatever the reference raises, it refuses
        return e


def _eager(sd, strict: bool):
    torch.manual_seed(SEED)
    m = build()
    if isinstance(sd, Exception):
        return m, sd, None
    try:
        result = m.load_state_dict(sd, strict=strict)
    except Exception as e:  # noqa: BLE001
        return m, e, None
    return m, None, (sorted(result.missing_keys), sorted(result.unexpected_keys))


def _ours(m, path: str, strict: bool, before, state):
    """The problem with loading ``path`` into ``m``, or None; and whether it loaded."""
    from deferinit import CheckpointError
    from deferinit.materialize import load_checkpoint

    try:
        result = load_checkpoint(m, path, strict=strict)
    except CheckpointError as e:
        if state(m) != before:
            return f"changed the module before raising {type(e).__name__}: {e}", False, None
        return None, False, str(e)
    except Exception as e:  # noqa: BLE001
        return f"raised {type(e).__name__} (not a CheckpointError): {e}\n{traceback.format_exc()[-1500:]}", False, None
    return None, True, (sorted(result.missing_keys), sorted(result.unexpected_keys))


def check(kind: str, path: str, strict: bool) -> dict:
    from deferinit import deferred_init, graph_of
    from deferinit.materialize import materialize_module

    ref = reference(kind, path)
    eager, ref_error, ref_keys = _eager(ref, strict)
    out = {"reference": "refused" if ref_error is not None else "loaded"}

    def values(m):
        return {k: v.clone() for k, v in m.state_dict().items()}

    for how in ("deferred", "real"):
        torch.manual_seed(SEED)
        if how == "deferred":
            m = deferred_init(build)
            state = lambda m: str(graph_of(m))  # noqa: E731
        else:
            m = build()
            state = lambda m: [(k, bytes(_bits(v).numpy())) for k, v in m.state_dict().items()]  # noqa: E731
        problem, loaded, detail = _ours(m, path, strict, state(m), state)
        out[how] = "loaded" if loaded else "refused" if problem is None else "problem"
        if problem is None and loaded:
            if ref_error is not None:
                problem = f"loaded what the reference refuses ({type(ref_error).__name__}: {str(ref_error)[:300]})"
            elif detail != ref_keys:
                problem = f"missing/unexpected keys {detail}, load_state_dict says {ref_keys}"
            else:
                try:
                    if how == "deferred":
                        materialize_module(m)
                    problem = _same(values(m), values(eager))
                except Exception as e:  # noqa: BLE001
                    problem = f"materializing raised {type(e).__name__}: {e}"
        if problem is not None:
            out["problem"] = f"{how} module: {problem}"
            return out
        out[f"{how}_error"] = detail if not loaded else None
    return out


def _dcp_reference(path: str):
    """``dcp.load``'s values in an eager module (seeded as ours), or the exception it raises."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(SEED)
    m = build()
    state = m.state_dict()
    try:
        dcp.load(state, checkpoint_id=path, no_dist=True)
    except BaseException as e:  # noqa: BLE001 - dcp.load's CheckpointException is a BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        return e
    return {k: v.clone() for k, v in m.state_dict().items()}


def check_dcp(path: str) -> dict:
    """A distributed checkpoint: ``load_checkpoint`` (strict, as ``dcp.load`` wants
    every key) gives ``dcp.load``'s values or raises ``CheckpointError``, the module
    unchanged.  ``dcp.load`` unpickles ``.metadata`` with ``pickle.load``: it runs
    only on mutants ``load_checkpoint`` read, whose pickle names DCP classes only."""
    from deferinit import deferred_init, graph_of
    from deferinit.materialize import materialize_module

    out, reference = {}, None
    for how in ("deferred", "real"):
        torch.manual_seed(SEED)
        if how == "deferred":
            m = deferred_init(build)
            state = lambda m: str(graph_of(m))  # noqa: E731
        else:
            m = build()
            state = lambda m: [(k, bytes(_bits(v).numpy())) for k, v in m.state_dict().items()]  # noqa: E731
        problem, loaded, detail = _ours(m, path, True, state(m), state)
        out[how] = "loaded" if loaded else "refused" if problem is None else "problem"
        if problem is None and loaded:
            if reference is None:
                reference = _dcp_reference(path)
                out["reference"] = "refused" if isinstance(reference, BaseException) else "loaded"
            if isinstance(reference, BaseException):
                problem = f"loaded what dcp.load refuses ({type(reference).__name__}: {str(reference)[:300]})"
            else:
                try:
                    if how == "deferred":
                        materialize_module(m)
                    problem = _same({k: v.clone() for k, v in m.state_dict().items()}, reference)
                except Exception as e:  # noqa: BLE001
                    problem = f"materializing raised {type(e).__name__}: {e}"
        if problem is not None:
            out["problem"] = f"{how} module: {problem}"
            return out
        out[f"{how}_error"] = detail if not loaded else None
    return out


def save_sharded(rank: int, world_size: int, values: dict, path: str) -> dict:
    """``dcp.save`` of the module holding ``values``, its parameters sharded by FSDP2
    over the ranks (a seed of the distributed checkpoint fuzzer: chunks per rank)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    m = build()
    m.load_state_dict(values)
    fully_shard(m, mesh=init_device_mesh("cpu", (world_size,)))
    dcp.save(m.state_dict(), checkpoint_id=path)
    return {"saved": True}


def main(jobs_path: str) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    with open(jobs_path) as f:
        jobs = [json.loads(line) for line in f]
    for job in jobs:
        print(f"start {job['i']}", flush=True)
        out = check_dcp(job["path"]) if job["kind"] == "dcp" else check(job["kind"], job["path"], job["strict"])
        out["i"] = job["i"]
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "--one":
        warnings.simplefilter("ignore")
        one = check_dcp(sys.argv[3]) if sys.argv[2] == "dcp" else check(sys.argv[2], sys.argv[3], True)
        print(json.dumps(one, indent=1))
    else:
        main(sys.argv[1])
