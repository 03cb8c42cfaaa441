"""Rank bodies for the multi-process tests (tests/materialize/test_distributed.py).

Each ``case_*`` function runs on one rank of a gloo process group started by
:func:`multiproc.run_ranks` and raises (an ``AssertionError`` with a message)
when a check fails; the parent test reports that rank's traceback.  They
live in an importable module because spawn children import them by name.
Every check compares against eager PyTorch built with the same seed.
"""

from __future__ import annotations

import contextlib
import os
import time

import torch
import torch.distributed as dist
from torch import nn

from deferinit import deferred_init, is_deferred
from deferinit.materialize import materialize_module, materialize_tensor


# -- models ----------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 3 * d + 1)  # rows not divisible by the world size
        self.fc2 = nn.Linear(3 * d + 1, d)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, d))

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(self.norm(x)))) * self.scale


class Net(nn.Module):
    def __init__(self, d: int = 8, n: int = 3, vocab: int = 11, out: int = 5):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        nn.init.trunc_normal_(self.embed.weight, std=0.5)  # data-dependent initialiser
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, out)  # 5 rows: rank 3 of 4 holds an empty shard

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class MLP(nn.Module):
    def __init__(self, d: int = 6, hidden: int = 12):
        super().__init__()
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return self.norm(self.down(torch.relu(self.up(x))))


def check(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def shard_of(full: torch.Tensor, rank: int, world_size: int, dim: int = 0) -> torch.Tensor:
    """Rank ``rank``'s piece of ``full`` as FSDP2 and DTensor cut it (torch.chunk, empty past the end)."""
    chunks = torch.chunk(full, world_size, dim=dim)
    if rank < len(chunks):
        return chunks[rank]
    shape = list(full.shape)
    shape[dim] = 0
    return full.new_zeros(shape)


def _fully_shard_net(model: Net) -> None:
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)


# -- FSDP2 -----------------------------------------------------------------------------


def case_fsdp2(rank: int, world_size: int) -> dict:
    """fully_shard a deferred Net; materialize; compare with eager (values, generator,
    a training step against eager FSDP2 with the same seed)."""
    from torch.distributed.fsdp import FSDPModule

    torch.manual_seed(0)
    eager_plain = Net()
    eager_next = torch.rand(4)

    torch.manual_seed(0)
    model = deferred_init(Net)
    _fully_shard_net(model)
    check(is_deferred(model), "a sharded deferred module is still deferred")
    for name, p in model.named_parameters():
        check(type(p).__name__ == "DTensor" and is_deferred(p), f"{name} is not a deferred DTensor")
    locals_before = {name: p._local_tensor for name, p in model.named_parameters()}

    materialize_module(model)
    check(not is_deferred(model), "materialize_module left deferred tensors")
    check(torch.equal(torch.rand(4), eager_next), "the generator is not where eager construction left it")

    eager = dict(eager_plain.named_parameters())
    for name, p in model.named_parameters():
        local = p._local_tensor
        check(local is locals_before[name], f"{name}: the local shard object was replaced")
        check(type(local) is torch.Tensor, f"{name}: local shard is {type(local).__name__}")
        expected = shard_of(eager[name].detach(), rank, world_size)
        check(local.shape == expected.shape, f"{name}: shard shape {tuple(local.shape)} != {tuple(expected.shape)}")
        check(torch.equal(local, expected), f"{name}: rank {rank}'s shard differs from eager's slice")
        check(torch.equal(p.full_tensor(), eager[name].detach()), f"{name}: gathered tensor differs from eager")
        check(p.requires_grad, f"{name}: requires_grad lost")
    for name, b in model.named_buffers():
        check(torch.equal(b, dict(eager_plain.named_buffers())[name]), f"buffer {name} differs from eager")

    # FSDP2's padded flat shard is real and is the memory the local shard views.
    for sub in model.modules():
        if isinstance(sub, FSDPModule):
            for fp in sub._get_fsdp_state()._fsdp_param_group.fsdp_params:
                data = fp._sharded_param_data
                check(type(data) is torch.Tensor, f"FSDP padded shard is {type(data).__name__}")
                local = fp.sharded_param._local_tensor
                if local.numel():
                    check(data.data_ptr() == local.data_ptr(), "local shard does not view FSDP's padded shard")

    # A training step, against eager FSDP2 built with the same seed.
    torch.manual_seed(0)
    reference = Net()
    _fully_shard_net(reference)
    torch.manual_seed(100 + rank)
    ids = torch.randint(0, 11, (4, 6))
    losses = []
    for m in (model, reference):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        for _ in range(2):
            loss = m(ids).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    check(losses[0] == losses[1], f"training losses differ: {losses}")
    ref = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        check(torch.equal(p._local_tensor, ref[name]._local_tensor), f"{name}: differs from eager FSDP2 after training")
        local = p._local_tensor
        check(local is locals_before[name], f"{name}: FSDP replaced the local shard (it did not alias its padded shard)")
    return {"params": len(eager)}


def case_fsdp2_materialize_tensor(rank: int, world_size: int) -> None:
    """materialize_tensor on DTensor parameters one by one, in reverse order."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    eager = Net(n=2)
    torch.manual_seed(0)
    model = deferred_init(Net, n=2)
    fully_shard(model)
    params = list(model.named_parameters())
    for name, p in reversed(params):
        check(materialize_tensor(p) is p, "materialize_tensor returns its argument")
    reference = dict(eager.named_parameters())
    for name, p in params:
        check(torch.equal(p._local_tensor, shard_of(reference[name].detach(), rank, world_size)), f"{name} differs")
    materialize_module(model)  # the buffers
    check(not is_deferred(model), "buffers still deferred")
    ids = torch.randint(0, 11, (2, 3), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        check(torch.allclose(model(ids), eager(ids), atol=1e-6), "forward differs from eager")


# -- memory ----------------------------------------------------------------------------


class Wide(nn.Module):
    """Eight 8 MiB parameters."""

    def __init__(self, n: int = 8, d: int = 1024):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, 2 * d, bias=False) for _ in range(n))


def _rss_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(field)


def case_memory(rank: int, world_size: int) -> dict:
    """Peak resident memory while materializing one rank's FSDP2 shards."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = deferred_init(Wide)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    param_mib = 8.0
    shards_mib = param_mib * len(model.layers) / world_size
    from deferinit.materialize.distributed import sharded_memory_cost

    plan = sharded_memory_cost(model)
    planned = (sum(g.kept_bytes for g in plan) + max(g.transient_bytes for g in plan)) / 2**20
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets the peak resident size (VmHWM)
    except OSError:
        return {"skipped": "cannot reset the peak resident size here"}
    before = _rss_mib("VmRSS")
    materialize_module(model)
    peak = _rss_mib("VmHWM") - before
    after = _rss_mib("VmRSS") - before
    return {"peak": peak, "after": after, "shards": shards_mib, "param": param_mib, "planned": planned}


# -- tensor parallel ---------------------------------------------------------------------


def case_tp(rank: int, world_size: int) -> None:
    """distribute_tensor and parallelize_module on deferred tensors, both with the
    default src_data_rank (a scatter/broadcast recorded as its local equivalent)
    and src_data_rank=None."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world_size,))
    for src in (0, None):
        torch.manual_seed(0)
        eager = torch.randn(7, 5)
        torch.manual_seed(0)
        deferred = deferred_init(torch.randn, 7, 5)
        for placement in (Shard(0), Shard(1), Replicate()):
            d = distribute_tensor(deferred, mesh, [placement], src_data_rank=src)
            check(is_deferred(d), "distribute_tensor of a deferred tensor is deferred")
            materialize_tensor(d)
            dim = placement.dim if isinstance(placement, Shard) else None
            expected = eager if dim is None else shard_of(eager, rank, world_size, dim)
            check(torch.equal(d._local_tensor, expected), f"{placement} src_data_rank={src}: local differs")
            check(torch.equal(d.full_tensor(), eager), f"{placement} src_data_rank={src}: full tensor differs")
            # The eager DTensor with the same seed holds the same local tensor.
            torch.manual_seed(0)
            reference = distribute_tensor(torch.randn(7, 5), mesh, [placement], src_data_rank=src)
            check(torch.equal(reference._local_tensor, d._local_tensor), f"{placement}: differs from eager DTensor")

        # In a module: the uneven piece (a view of the padded scatter output,
        # or of the full tensor) is copied out of the larger memory.
        torch.manual_seed(0)
        holder = nn.Module()
        holder.w = nn.Parameter(distribute_tensor(deferred_init(torch.randn, 7, 5), mesh, [Shard(0)], src_data_rank=src))
        materialize_module(holder)
        local = holder.w._local_tensor
        check(torch.equal(local, shard_of(eager, rank, world_size)), f"module, src_data_rank={src}: local differs")
        check(local.untyped_storage().nbytes() == local.numel() * local.element_size(),
              f"module, src_data_rank={src}: the shard holds {local.untyped_storage().nbytes()} bytes")

        plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
        torch.manual_seed(0)
        eager_mlp = MLP()
        next_eager = torch.rand(3)
        torch.manual_seed(0)
        mlp = deferred_init(MLP)
        parallelize_module(mlp, mesh, plan, src_data_rank=src)
        materialize_module(mlp)
        check(torch.equal(torch.rand(3), next_eager), "generator not where eager left it")
        reference = dict(eager_mlp.named_parameters())
        for name, p in mlp.named_parameters():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            check(torch.equal(full.detach(), reference[name].detach()), f"{name} (src_data_rank={src}) differs")
            local = getattr(p, "_local_tensor", p)
            # A shard does not keep the full tensor it was cut from alive.
            check(local.untyped_storage().nbytes() == local.numel() * local.element_size(),
                  f"{name}: the local shard holds {local.untyped_storage().nbytes()} bytes")
        torch.manual_seed(1)
        x = torch.randn(4, 6)
        check(torch.allclose(mlp(x), eager_mlp(x), atol=1e-6), "forward differs from eager")
        loss = mlp(x).pow(2).sum()
        loss.backward()
        torch.optim.SGD(mlp.parameters(), lr=0.1).step()


def case_tp_rank_seeds(rank: int, world_size: int) -> str:
    """Ranks seeded differently: the default scatter must refuse (on every rank);
    src_data_rank=None keeps each rank's own values, as eager does."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from deferinit.collectives import CollectiveError

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(rank)
    deferred = deferred_init(torch.randn, 6, 4)
    try:
        distribute_tensor(deferred, mesh, [Shard(0)])
    except CollectiveError as e:
        message = str(e)
    else:
        raise AssertionError("a scatter of tensors with different recipes was recorded")
    d = distribute_tensor(deferred, mesh, [Shard(0)], src_data_rank=None)
    materialize_tensor(d)
    torch.manual_seed(rank)
    reference = distribute_tensor(torch.randn(6, 4), mesh, [Shard(0)], src_data_rank=None)
    check(torch.equal(d._local_tensor, reference._local_tensor), "src_data_rank=None differs from eager")
    try:
        d2 = distribute_tensor(deferred_init(torch.ones, 4), mesh, [Shard(0)], src_data_rank=None)
        d2.full_tensor()  # an all_gather of values that do not exist yet
    except CollectiveError:
        pass
    else:
        raise AssertionError("full_tensor() of a deferred DTensor did not raise")
    return message


# -- FSDP1 -------------------------------------------------------------------------------


def case_fsdp1(rank: int, world_size: int) -> dict:
    """FullyShardedDataParallel (FSDP1) with param_init_fn, and with FSDP's own
    check_fn form; full state dicts equal eager."""
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from deferinit.materialize.distributed import fsdp1_hooks, param_init_fn

    torch.manual_seed(0)
    eager = Net()
    eager_state = {k: v.clone() for k, v in eager.state_dict().items()}
    results = {}
    calls: list = []

    def recording_init(module):
        own = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
        children_before = {id(t): is_deferred(t) for c in module.children() for t in c.parameters()}
        param_init_fn(module)
        check(all(not is_deferred(t) for t in own), f"{type(module).__name__}: own tensors still deferred")
        for c in module.children():
            for t in c.parameters():
                if id(t) in children_before:
                    check(is_deferred(t) == children_before[id(t)], "param_init_fn touched a child's tensors")
        calls.append(type(module).__name__)

    for form in ("param_init_fn", "check_fn"):
        torch.manual_seed(0)
        model = deferred_init(Net)
        kwargs = {"param_init_fn": recording_init} if form == "param_init_fn" else {}
        with fsdp1_hooks():
            wrapped = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"), **kwargs)
        with FSDP.state_dict_type(wrapped, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False)):
            state = wrapped.state_dict()
        check(state.keys() == eager_state.keys(), f"{form}: state dict keys differ")
        for key, value in eager_state.items():
            check(torch.equal(state[key], value), f"{form}: {key} differs from eager")
        torch.manual_seed(3)
        ids = torch.randint(0, 11, (2, 5))
        check(torch.allclose(wrapped(ids), eager(ids), atol=1e-6), f"{form}: forward differs")
        wrapped(ids).sum().backward()
        results[form] = True
    results["calls"] = calls
    return results


def case_fsdp1_without_hooks(rank: int, world_size: int) -> dict:
    """torchdistX-style FSDP1 outside fsdp1_hooks() (a param_init_fn FSDP1 never
    calls, or FSDP's own detection), and inside it with a param_init_fn that
    leaves the module deferred: FSDP1DeferredModuleError naming the fix, on
    every rank; the fix it names then gives eager's values."""
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from deferinit import FSDP1DeferredModuleError
    from deferinit.fake import FakeDataAccessError
    from deferinit.materialize.distributed import fsdp1_hooks, param_init_fn

    messages = {}
    forms = {
        "torchdistx param_init_fn": (False, {"param_init_fn": lambda m: materialize_module(m)}),
        "FSDP's own detection": (False, {}),
        "param_init_fn that does nothing": (True, {"param_init_fn": lambda m: None}),
    }
    for form, (hooked, kwargs) in forms.items():
        torch.manual_seed(0)
        model = deferred_init(Net)
        try:
            with fsdp1_hooks() if hooked else contextlib.nullcontext():
                FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"), **kwargs)
        except FSDP1DeferredModuleError as e:
            check(isinstance(e.__cause__, FakeDataAccessError), f"{form}: the data access is not the cause")
            messages[form] = str(e)
        else:
            raise AssertionError(f"{form}: FSDP1 on a deferred model did not raise")
    torch.manual_seed(0)
    eager = Net()
    torch.manual_seed(0)
    model = deferred_init(Net)
    with fsdp1_hooks():  # the fix the message names
        wrapped = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"),
                       param_init_fn=param_init_fn)
    with FSDP.state_dict_type(wrapped, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False)):
        state = wrapped.state_dict()
    for key, value in eager.state_dict().items():
        check(torch.equal(state[key], value), f"after the fix: {key} differs from eager")
    return messages


def case_fsdp1_one_rank_without_hooks(rank: int, world_size: int) -> tuple:
    """On one rank (NO_SHARD) FSDP1 never reads the flat parameter's memory: a
    model wrapped outside fsdp1_hooks() stays deferred, and its first forward
    pass warns, naming fsdp1_hooks(); returns the warnings and the error FSDP1's
    forward pass then meets."""
    import warnings

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from deferinit import DeferredModuleWarning

    wrapped = FSDP(deferred_init(Net), device_id=torch.device("cpu"), param_init_fn=lambda m: materialize_module(m))
    check(is_deferred(wrapped), "FSDP1 materialized the model without fsdp1_hooks()")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        error = None
        try:
            wrapped(torch.randint(0, 11, (2, 5)))
        except Exception as e:  # noqa: BLE001 - FSDP1 then fails on fakes; the warning came first
            error = f"{type(e).__name__}: {e}"
    return [str(w.message) for w in caught if issubclass(w.category, DeferredModuleWarning)], error


# -- transformers Llama ------------------------------------------------------------------


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="eager",
    )


def case_llama(rank: int, world_size: int) -> dict:
    """A transformers Llama, FSDP2-sharded; the gathered full state dict equals eager."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM

    config = llama_config()
    torch.manual_seed(0)
    eager = LlamaForCausalLM(config)
    torch.manual_seed(0)
    model = deferred_init(LlamaForCausalLM, config)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    start = time.perf_counter()
    materialize_module(model)
    seconds = time.perf_counter() - start
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    expected = eager.state_dict()
    check(full.keys() == expected.keys(), f"keys differ: {sorted(set(full) ^ set(expected))}")
    for key, value in expected.items():
        got = full[key]
        got = got.full_tensor() if hasattr(got, "full_tensor") else got
        check(torch.equal(got, value), f"{key} differs from eager")
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        check(torch.allclose(model(ids).logits, eager(ids).logits, atol=1e-5), "logits differ from eager")
    loss = model(ids, labels=ids).loss
    loss.backward()
    torch.optim.AdamW(model.parameters(), lr=1e-3).step()
    return {"tensors": len(expected), "materialize_s": seconds}


# -- the harness itself ------------------------------------------------------------------


def case_one_rank_fails(rank: int, world_size: int) -> None:
    """Rank 1 raises while the others wait in a collective."""
    if rank == 1:
        raise ValueError("rank 1 failed on purpose")
    dist.barrier()


def case_one_rank_hangs(rank: int, world_size: int) -> None:
    if rank == 0:
        time.sleep(3600)


def case_pid(rank: int, world_size: int) -> int:
    return os.getpid()


def case_fsdp2_progress(rank: int, world_size: int) -> dict:
    """materialize_module(progress=True) of an FSDP2 model, stderr captured as a log:
    the summary counts this rank's shards of the parameters and the buffers."""
    import io
    import sys

    torch.manual_seed(0)
    eager = Net()
    torch.manual_seed(0)
    model = deferred_init(Net)
    _fully_shard_net(model)
    stream = io.StringIO()
    real_stderr, sys.stderr = sys.stderr, stream
    try:
        materialize_module(model, progress=True)
    finally:
        sys.stderr = real_stderr
    check(not is_deferred(model), "materialize_module left deferred tensors")
    shards = [shard_of(p.detach(), rank, world_size) for p in eager.parameters()]
    tensors = shards + list(eager.buffers())
    for name, p in model.named_parameters():
        check(torch.equal(p._local_tensor, shard_of(dict(eager.named_parameters())[name].detach(), rank, world_size)),
              f"{name}: rank {rank}'s shard differs from eager's slice")
    return {"log": stream.getvalue(), "tensors": len(tensors),
            "bytes": sum(t.numel() * t.element_size() for t in tensors)}
