"""Mutation fuzzing of checkpoint files: every byte sequence is untrusted input.

Valid checkpoints (a safetensors file; ``torch.save`` archives in torch's
layout, re-zipped stored and deflated, big-endian; folders with an index
over safetensors or ``torch.save`` shards; distributed checkpoints saved by
one process and by two FSDP2 ranks) are corrupted by
tests/checkpoint_mutations.py, and each mutant is checked by
tests/checkpoint_fuzz_worker.py against the reference loaders: either
``load_checkpoint`` gives the values ``load_state_dict`` gets from
``safetensors.torch.load_file`` / ``torch.load(weights_only=True)`` (for a
distributed checkpoint: ``dcp.load`` into the eager module), or it
raises ``CheckpointError`` and the module (deferred or real) is unchanged;
never another exception, never a crash.  Mutants run in child processes,
many per process; a process that dies names the mutant it was checking.

Profiles (docs/testing.md): ``ci`` (default) checks a fixed set of mutants,
the same every run; ``CHECKPOINT_FUZZ_PROFILE=long`` checks ten times as
many from a new seed each run (printed; ``CHECKPOINT_FUZZ_SEED`` sets it).
"""

from __future__ import annotations

import json
import os
import pickletools
import random
import shutil
import subprocess
import sys
import zipfile

import pytest
import torch
from safetensors.torch import save_file

from checkpoint_mutations import bytes_mutation, dcp_mutation, index_mutation, safetensors_mutation, torch_mutation
from checkpoint_zip import rezip

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
WORKER = os.path.join(ROOT, "tests", "checkpoint_fuzz_worker.py")

PROFILE = os.environ.get("CHECKPOINT_FUZZ_PROFILE", "ci")
COUNTS = {"safetensors": 800, "torch": 1000, "index": 350, "dcp": 300}
if PROFILE == "long":
    COUNTS = {k: 10 * v for k, v in COUNTS.items()}
    SEED = int(os.environ.get("CHECKPOINT_FUZZ_SEED", random.SystemRandom().randrange(2**31)))
else:
    SEED = int(os.environ.get("CHECKPOINT_FUZZ_SEED", 0))
WORKERS = 2
_UNIT = {"FloatStorage": 4, "DoubleStorage": 8, "HalfStorage": 2, "LongStorage": 8, "BoolStorage": 1, "ComplexFloatStorage": 4}


def state_dicts():
    """The checkpoint's tensors: contiguous, and as views sharing storages."""
    g = torch.Generator().manual_seed(11)
    big = torch.randn(4, 5, generator=g)
    views = {
        "lin.weight": big[:, :3], "lin.bias": big[:, 4], "norm.weight": torch.randn(4, generator=g),
        "norm.bias": torch.randn(4, generator=g), "steps": torch.tensor(7), "mask": torch.rand(2, 3, generator=g) > 0.5,
        "h16": torch.randn(5, generator=g).half(), "cplx": torch.randn(2, dtype=torch.complex64, generator=g),
        "wide": torch.randn(2, 2, generator=g, dtype=torch.float64).t(),
    }
    return {k: v.contiguous() for k, v in views.items()}, views


def _records(path):
    zf = zipfile.ZipFile(path)
    names = [i.filename for i in zf.infolist()]
    return names, {n: zf.read(n) for n in names}


def big_endian(src: str, dst: str) -> None:
    """The archive as a big-endian machine saves it: every storage's elements
    byte-swapped (complex numbers' halves apart) and ``byteorder`` ``big``."""
    names, records = _records(src)
    pkl = next(n for n in names if n.endswith("data.pkl"))
    prefix = pkl[: -len("data.pkl")]
    unit = None
    for op, arg, _ in pickletools.genops(records[pkl]):
        if op.name == "GLOBAL" and arg.endswith("Storage"):
            unit = _UNIT[arg.split(" ")[1]]
        elif op.name == "BINUNICODE" and unit is not None:
            data = records[prefix + "data/" + arg]
            records[prefix + "data/" + arg] = b"".join(data[i:i + unit][::-1] for i in range(0, len(data), unit))
            unit = None
    records[prefix + "byteorder"] = b"big"
    with open(dst, "wb") as f:
        f.write(rezip(names, records))


def _index(folder, name, shards, save, ext):
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"{name}-0000{i + 1}-of-0000{len(shards)}.{ext}"
        save(shard, os.path.join(folder, file))
        weight_map.update({k: file for k in shard})
    index = "model.safetensors.index.json" if ext == "safetensors" else "pytorch_model.bin.index.json"
    with open(os.path.join(folder, index), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)


def make_seeds(root: str) -> dict:
    """``name -> (group, kind, path)`` of valid checkpoints."""
    contig, views = state_dicts()
    os.makedirs(root, exist_ok=True)
    seeds = {"safetensors": ("safetensors", "safetensors", os.path.join(root, "model.safetensors"))}
    save_file(contig, seeds["safetensors"][2])
    torch_path = os.path.join(root, "model.pt")
    torch.save(views, torch_path)
    seeds["torch"] = ("torch", "torch", torch_path)
    names, records = _records(torch_path)
    for name, method in (("stored", zipfile.ZIP_STORED), ("deflated", zipfile.ZIP_DEFLATED)):
        path = os.path.join(root, f"{name}.pt")
        with open(path, "wb") as f:
            f.write(rezip(names, records, method))
        seeds[name] = ("torch", "torch", path)
    seeds["big"] = ("torch", "torch", os.path.join(root, "big.pt"))
    big_endian(torch_path, seeds["big"][2])
    keys = sorted(contig)
    halves = [{k: contig[k] for k in keys[:4]}, {k: contig[k] for k in keys[4:]}]
    for name, save, ext in (("model", save_file, "safetensors"), ("pytorch_model", torch.save, "bin")):
        folder = os.path.join(root, f"index_{ext}")
        os.makedirs(folder)
        _index(folder, name, halves, save, ext)
        seeds[f"index_{ext}"] = ("index", "index", folder)
    return seeds


def make_dcp_seeds(root: str) -> dict:
    """Distributed checkpoints of the same values: ``dcp.save`` by one process, and
    by two gloo ranks with the parameters sharded by FSDP2 (two chunks each)."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from checkpoint_fuzz_worker import save_sharded
    from multiproc import run_ranks

    contig, _ = state_dicts()
    seeds = {name: ("dcp", "dcp", os.path.join(root, name)) for name in ("dcp_one", "dcp_two")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(contig, checkpoint_id=seeds["dcp_one"][2], no_dist=True)
    run_ranks(save_sharded, 2, contig, seeds["dcp_two"][2], timeout=300)
    return seeds


def make_mutant(seeds: dict, group: str, i: int, root: str) -> dict:
    """Mutant ``i`` of ``group`` (the same for the same seed, whatever else is made)."""
    names = sorted(n for n, (g, _, _) in seeds.items() if g == group)
    rng = random.Random(f"{SEED}-{group}-{i}")
    name = rng.choice(names)
    _, kind, src = seeds[name]
    steps = rng.choices([1, 2, 3], weights=[6, 3, 1])[0]
    where = os.path.join(root, str(i))
    os.makedirs(where)
    done = []
    if kind == "dcp":
        import pickle

        path = os.path.join(where, "ckpt")
        shutil.copytree(src, path)
        secret = os.path.join(where, "secret.distcp")
        shutil.copy(os.path.join(src, sorted(n for n in os.listdir(src) if n.endswith(".distcp"))[0]), secret)
        with open(os.path.join(src, ".metadata"), "rb") as f:
            state = {"meta": pickle.load(f)}  # the seed's, written by dcp.save here: trusted
        for _ in range(steps):
            done.append(dcp_mutation(path, state, secret, rng))
    elif kind == "index":
        path = os.path.join(where, "ckpt")
        shutil.copytree(src, path)
        secret = os.path.join(where, "secret.safetensors")
        save_file(state_dicts()[0], secret)
        for _ in range(steps):
            done.append(index_mutation(path, secret, rng))
    else:
        with open(src, "rb") as f:
            blob = f.read()
        mutate = safetensors_mutation if kind == "safetensors" else torch_mutation
        for _ in range(steps):
            how = mutate if rng.random() < 0.85 else bytes_mutation
            try:
                blob, what = how(blob, rng)
            except Exception as e:  # noqa: BLE001 - a mutator lost on an earlier mutant: plain bytes
                blob, what = bytes_mutation(blob, rng)
                what = f"({how.__name__}: {type(e).__name__}) {what}"
            done.append(what)
        path = os.path.join(where, os.path.basename(src))
        with open(path, "wb") as f:
            f.write(blob)
    return {"i": i, "kind": kind, "path": path, "strict": rng.random() < 0.75, "what": f"{name}: " + "; ".join(done)}


def make_mutants(seeds: dict, group: str, count: int, root: str) -> list:
    """The seeds of ``group`` as they are, then mutants up to ``count``."""
    names = sorted(n for n, (g, _, _) in seeds.items() if g == group)
    jobs = [{"i": i, "kind": seeds[n][1], "path": seeds[n][2], "strict": True, "what": f"{n}: unmutated"}
            for i, n in enumerate(names)]
    return jobs + [make_mutant(seeds, group, i, root) for i in range(len(jobs), count)]


def _start(jobs: list, root: str, n: int):
    jobs_path = os.path.join(root, f"jobs-{n}.jsonl")
    with open(jobs_path, "w") as f:
        for job in jobs:
            f.write(json.dumps(job) + "\n")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, WORKER, jobs_path], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=ROOT)


def run_mutants(jobs: list, root: str) -> tuple[list, list]:
    """``(results, failures)``: a worker that dies names its mutant and the rest go on."""
    by_index = {job["i"]: job for job in jobs}
    results, failures, pending, runs = [], [], [jobs[k::WORKERS] for k in range(WORKERS)], 0
    while any(pending) and len(failures) < 20:
        procs = []
        for batch in pending:
            if batch:
                runs += 1
                procs.append((batch, _start(batch, root, runs)))
        pending = []
        for batch, proc in procs:
            try:
                out, err = proc.communicate(timeout=1800)
            except BaseException:
                # The test's own timeout (a mutant that hangs a reader): no worker outlives it.
                for _, other in procs:
                    other.kill()
                raise
            started, done = None, set()
            for line in out.splitlines():
                if line.startswith("start "):
                    started = int(line.split()[1])
                elif line.startswith("{"):
                    result = json.loads(line)
                    done.add(result["i"])
                    results.append(result)
                    if "problem" in result:
                        failures.append((by_index[result["i"]], result["problem"]))
            if proc.returncode != 0:
                crashed = by_index.get(started)
                failures.append((crashed, f"the worker died (exit {proc.returncode}) checking it:\n{err[-2000:]}"))
                rest = [job for job in batch if job["i"] not in done and job["i"] != started]
                pending.append(rest)
    return results, failures


def _report(failures: list) -> str:
    lines = [f"{len(failures)} mutant(s) failed (profile {PROFILE}, seed {SEED}):"]
    for job, problem in failures[:12]:
        if job is None:
            lines.append(f"- a worker died before its first mutant: {problem}")
            continue
        lines.append(f"- #{job['i']} {job['what']}\n  file: {job['path']} (strict={job['strict']})\n  {problem}\n"
                     f"  reproduce: python tests/checkpoint_fuzz_worker.py --one {job['kind']} {job['path']}")
    return "\n".join(lines)


@pytest.mark.timeout(4 * 3600 if PROFILE == "long" else 600)
@pytest.mark.parametrize("group", ["safetensors", "torch", "index", "dcp"])
def test_mutants_load_as_the_reference_or_raise_checkpoint_error(group, tmp_path):
    if group == "dcp":
        pytest.importorskip("torch.distributed.checkpoint")
        if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
            pytest.skip("needs torch.distributed with gloo")
    seeds = (make_dcp_seeds if group == "dcp" else make_seeds)(str(tmp_path / "seeds"))
    jobs = make_mutants(seeds, group, COUNTS[group], str(tmp_path))
    results, failures = run_mutants(jobs, str(tmp_path))
    assert not failures, _report(failures)
    assert len(results) == len(jobs)
    outcomes = {r["i"]: r for r in results}
    # The seeds themselves load, and the mutants are neither all refused nor all loaded.
    unmutated = [j["i"] for j in jobs if j["what"].endswith("unmutated")]
    assert all(outcomes[i]["deferred"] == outcomes[i]["real"] == "loaded" for i in unmutated), [outcomes[i] for i in unmutated]
    loaded = sum(r["deferred"] == "loaded" for r in results)
    print(f"{group}: {len(results)} mutants, {loaded} loaded as the reference, {len(results) - loaded} refused (seed {SEED})")
    assert 0.02 * len(results) < loaded < 0.98 * len(results)
