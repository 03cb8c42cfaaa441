"""The training recipe of a planned step: the optimizer, mixed precision,
activation checkpointing, gradient accumulation, FSDP2 sharding.

Each is applied the way people apply it to a real model, with PyTorch's
(or transformers') own tools, so the trackers measure what the real step
would allocate (docs/planning.md, "The recipe people train with", says
which tool for each).  ``foreach`` defaults to what PyTorch picks for real
tensors on the device (the fakes' type would otherwise make it pick the
for-loop); an optimizer whose step reads values (as Adafactor does) cannot
step on fakes.

:func:`plan_step` applies a :class:`Recipe` and measures the step.
"""

from __future__ import annotations

import dataclasses
import inspect
import pkgutil

import torch

from .step import measure_step
from .trackers import local_tensor

#: Keyword arguments given to an optimizer unless the recipe sets them.
DEFAULT_ARGS = {"lr": 1e-4}
_EXTRA_DEFAULTS = {"SGD": {"momentum": 0.9}}


@dataclasses.dataclass
class Recipe:
    """How the step trains: optimizer, mixed precision, activation checkpointing,
    gradient accumulation, each applied with PyTorch's own tools
    (:mod:`deferinit.planning.recipe` says how).

    ``optimizer`` is a ``torch.optim`` class name in any case, ``module:Class``,
    or an optimizer class; ``optimizer_args`` its keyword arguments (``lr``
    defaults to 1e-4, SGD's ``momentum`` to 0.9); ``foreach`` None picks as
    PyTorch does for real tensors on the device; ``mixed_precision`` the
    compute dtype (``torch.bfloat16``) with fp32 master weights;
    ``checkpointing`` activation checkpointing of each block; ``accumulate``
    the number of micro-batches per optimizer step.

    Example::

        >>> Recipe(optimizer="adamw", optimizer_args={"lr": 3e-4, "betas": (0.9, 0.95)},
        ...        mixed_precision=torch.bfloat16, checkpointing=True, accumulate=4)
        Recipe(optimizer='adamw', optimizer_args={'lr': 0.0003, 'betas': (0.9, 0.95)}, foreach=None, mixed_precision=torch.bfloat16, checkpointing=True, accumulate=4)
    """

    optimizer: object = "adamw"
    optimizer_args: dict = dataclasses.field(default_factory=dict)
    foreach: bool | None = None
    mixed_precision: torch.dtype | None = None
    checkpointing: bool = False
    accumulate: int = 1


def optimizer_class(name, *, load=None) -> type:
    """The optimizer class ``name`` stands for: a class, a ``torch.optim`` class
    name in any case, or ``module:Class``, which ``load`` imports (default
    :func:`pkgutil.resolve_name`; the command line passes its own, which also
    takes ``file.py:Class``).  Raises ValueError for anything else.

    Example::

        >>> optimizer_class("adamw"), optimizer_class("torch.optim:SGD")
        (<class 'torch.optim.adamw.AdamW'>, <class 'torch.optim.sgd.SGD'>)
    """
    if isinstance(name, type):
        return name
    if ":" in name:
        cls = (load or _resolve)(name)
    else:
        found = {n.lower(): getattr(torch.optim, n) for n in dir(torch.optim)
                 if isinstance(getattr(torch.optim, n), type) and issubclass(getattr(torch.optim, n), torch.optim.Optimizer)}
        cls = found.get(name.lower())
        if cls is None or cls is torch.optim.Optimizer:
            names = ", ".join(sorted(n for n, c in found.items() if c is not torch.optim.Optimizer))
            raise ValueError(f"no optimizer {name!r} in torch.optim ({names}); or give module:Class")
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ValueError(f"{name} is not a torch.optim.Optimizer subclass")
    return cls


def _resolve(name: str):
    try:
        return pkgutil.resolve_name(name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"cannot import {name}: {e}") from e


def check_optimizer_args(recipe: Recipe) -> type:
    """The recipe's optimizer class, once its arguments are ones it takes."""
    cls = optimizer_class(recipe.optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in accepted.values()):
        unknown = sorted(set(recipe.optimizer_args) - set(accepted) - {"self", "params"})
        if unknown:
            names = ", ".join(n for n in accepted if n not in ("self", "params"))
            raise ValueError(f"{cls.__name__} takes no argument {', '.join(map(repr, unknown))} (it takes {names})")
    return cls


def make_optimizer(recipe: Recipe, params, device: torch.device) -> torch.optim.Optimizer:
    """The recipe's optimizer over ``params`` (a list), for tensors on ``device``."""
    cls = optimizer_class(recipe.optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    kwargs = {k: v for k, v in {**DEFAULT_ARGS, **_EXTRA_DEFAULTS.get(cls.__name__, {})}.items() if k in accepted}
    kwargs.update(recipe.optimizer_args)
    if "foreach" in accepted and "foreach" not in kwargs and not kwargs.get("fused"):
        foreach = recipe.foreach
        if foreach is None:  # what PyTorch picks for real tensors there
            from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices

            foreach = device.type in _get_foreach_kernels_supported_devices()
        kwargs["foreach"] = foreach
    return cls(params, **kwargs)


def describe_optimizer(optimizer: torch.optim.Optimizer, recipe: Recipe) -> str:
    """``AdamW foreach (lr=0.0003)``: the class, foreach/fused, and the arguments the recipe gave."""
    defaults = optimizer.defaults
    flags = [f for f in ("foreach", "fused") if defaults.get(f)]
    shown = {k: v for k, v in recipe.optimizer_args.items() if k not in ("foreach", "fused")}
    args = ", ".join(f"{k}={v!r}" for k, v in shown.items())
    return " ".join([type(optimizer).__name__, *flags]) + (f" ({args})" if args else "")


def blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Each block (with parameters) of every ``nn.ModuleList`` in ``model``: the
    decoder layers, which FSDP2 and activation checkpointing wrap one by one."""
    found = []
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList):
            found += [b for b in module if any(True for _ in b.parameters())]
    return found


def apply_checkpointing(model: torch.nn.Module) -> str:
    """Activation checkpointing of each block; returns how it was applied."""
    if getattr(model, "supports_gradient_checkpointing", False):
        # transformers >= 5 names it activation_checkpointing_enable (the old name warns)
        for name in ("activation_checkpointing_enable", "gradient_checkpointing_enable"):
            if hasattr(model, name):
                getattr(model, name)()
                return f"transformers' {name}()"
    found = blocks(model)
    if not found:
        raise ValueError(f"{type(model).__name__} has no nn.ModuleList of blocks to checkpoint")
    from torch.distributed._composable import checkpoint

    for block in found:
        checkpoint(block)
    return f"torch.distributed._composable.checkpoint on {len(found)} blocks"


def shard(model: torch.nn.Module, mesh, mixed_precision: torch.dtype | None = None) -> None:
    """FSDP2 as usually applied: each block of every ``nn.ModuleList``, then the
    whole model; with ``mixed_precision``, FSDP2's ``MixedPrecisionPolicy``
    (compute in that dtype, gradients reduced in fp32)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs = {"mesh": mesh}
    if mixed_precision is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=mixed_precision, reduce_dtype=torch.float32)
    for block in blocks(model):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)


def check_master_weights(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Mixed precision keeps fp32 master weights: refuse a model built in a lower dtype."""
    low = {p.dtype for p in model.parameters() if p.is_floating_point() and p.dtype != torch.float32}
    if low:
        names = ", ".join(sorted(str(d).replace("torch.", "") for d in low))
        raise ValueError(f"mixed precision ({str(dtype).replace('torch.', '')} compute) keeps float32 master "
                         f"weights, and the model has {names} parameters: build it in float32")


def prepare(model: torch.nn.Module, recipe: Recipe, mesh=None) -> list[str]:
    """Apply the recipe's checkpointing and sharding to ``model``; returns what was done, as text."""
    done = []
    if recipe.mixed_precision is not None:
        check_master_weights(model, recipe.mixed_precision)
    if recipe.checkpointing and not getattr(model, "supports_gradient_checkpointing", False) and not blocks(model):
        raise ValueError(f"{type(model).__name__} has no nn.ModuleList of blocks to checkpoint")
    if recipe.checkpointing:
        done.append("activation checkpointing: " + apply_checkpointing(model))
    if mesh is not None:
        shard(model, mesh, recipe.mixed_precision)
    if recipe.mixed_precision is not None:
        how = "FSDP2's MixedPrecisionPolicy, fp32 reduction" if mesh is not None else "torch.autocast"
        done.append(f"mixed precision: {str(recipe.mixed_precision).replace('torch.', '')} compute, "
                    f"float32 master weights ({how})")
    if recipe.accumulate > 1:
        done.append(f"gradient accumulation: {recipe.accumulate} micro-batches per step")
    return done


def plan_step(model, args, kwargs=None, recipe: Recipe | None = None, *, mesh=None, token_ids=None, timeline=None):
    """Prepare ``model`` for ``recipe`` (checkpointing, FSDP2 over ``mesh``), make its
    optimizer, and measure one step (:func:`~deferinit.planning.step.measure_step`).

    ``model(*args, **kwargs)`` is the forward pass; ``recipe`` defaults to
    ``Recipe()`` (AdamW, no mixed precision, no checkpointing, one
    micro-batch).  ``mesh``: a device mesh (:func:`~deferinit.planning.process_group.fake_ranks`)
    over which each block of every ``nn.ModuleList``, then the model, is
    sharded with FSDP2's ``fully_shard`` before the step.  ``token_ids`` and
    ``timeline`` are :func:`~deferinit.planning.step.measure_step`'s.
    Inside ``fake_mode`` (``args`` made there too) this plans the step of a
    deferred model; on real tensors it measures the real step.  The result,
    a :class:`~deferinit.planning.step.Measured`, also carries the optimizer
    (``.optimizer``) and the recipe's description (``.recipe``).  A recipe
    the model cannot take raises ValueError before the model is touched.

    Example (a real model; inside ``fake_mode`` a deferred one is planned the
    same way, see :mod:`deferinit.planning`)::

        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
        >>> recipe = Recipe(optimizer="sgd", optimizer_args={"lr": 0.1}, accumulate=2)
        >>> m = plan_step(model, (torch.randn(4, 64),), {}, recipe)
        >>> m.flops, m.recipe
        (155648, ['SGD (lr=0.1)', 'gradient accumulation: 2 micro-batches per step'])
    """
    recipe = recipe or Recipe()
    kwargs = kwargs or {}
    check_optimizer_args(recipe)  # refused before the model is touched
    if recipe.accumulate < 1:
        raise ValueError(f"accumulate must be at least 1, got {recipe.accumulate}")
    done = prepare(model, recipe, mesh)
    params = list(model.parameters())
    device = local_tensor(params[0]).device if params else torch.device("cpu")
    optimizer = make_optimizer(recipe, params, device)
    autocast = recipe.mixed_precision if mesh is None else None
    measured = measure_step(model, args, kwargs, optimizer, token_ids=token_ids, sharded=mesh is not None,
                            accumulate=recipe.accumulate, autocast=autocast, timeline=timeline)
    measured.optimizer = optimizer
    measured.recipe = [describe_optimizer(optimizer, recipe)] + done
    return measured
