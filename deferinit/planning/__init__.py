"""The training-step planner: one step of a model measured by PyTorch's own trackers, on fakes.

Will a training step of this model fit, and on how many devices?  Build
the model with :func:`deferinit.deferred_init` (nothing allocated), then
run one step (forward, loss, backward, the optimizer's step, ``zero_grad``)
inside :func:`deferinit.fake.fake_mode`, on fake devices, under PyTorch's
``MemTracker`` (``FSDPMemTracker`` for FSDP2) and ``FlopCounterMode``: the
figures are the ones those tools give for the real step, byte for byte.
The same calls on a real model measure the real step.

* :func:`plan_step` applies a :class:`Recipe` (optimizer, mixed precision,
  activation checkpointing, gradient accumulation, FSDP2 over a mesh) and
  measures the step; :func:`measure_step` measures a step with an
  optimizer you made.  Both return a :class:`Measured`.
* :func:`fake_ranks` gives a device mesh over PyTorch's fake process group,
  as one rank of ``N`` would have it.
* A :class:`Timeline` records the memory over the step; :func:`timeline_svg`
  and :func:`timeline_html` draw it, ``Timeline.snapshot()`` opens in
  PyTorch's memory visualizer.

``deferinit plan`` (:mod:`deferinit.cli.plan`) is this library's command
line; docs/planning.md explains the figures, docs/design.md maps the modules.

Example (a deferred Llama, float32 master weights, bf16 compute with FSDP2
over 2 fake ranks of fake CUDA devices; nothing is allocated)::

    >>> from deferinit import deferred_init
    >>> from deferinit.demo import LLAMA_TINY, Llama
    >>> with torch.device("cuda"):
    ...     model = deferred_init(Llama, LLAMA_TINY)
    >>> recipe = Recipe(mixed_precision=torch.bfloat16, checkpointing=True)
    >>> with fake_ranks(2, 0, "cuda") as mesh, fake_mode(fake_cuda=True):
    ...     ids = torch.randint(0, LLAMA_TINY.vocab_size, (2, 16), device="cuda")
    ...     m = plan_step(model, (ids,), {}, recipe, mesh=mesh, token_ids=ids)
    >>> for line in m.recipe:
    ...     print(line)
    AdamW foreach
    activation checkpointing: torch.distributed._composable.checkpoint on 4 blocks
    mixed precision: bfloat16 compute, float32 master weights (FSDP2's MixedPrecisionPolicy, fp32 reduction)
    >>> m.peak[torch.device("cuda", 0)]["Total"]   # rank 0's peak in bytes
    2069504
    >>> m.flops > 0   # the step's FLOPs as torch's FlopCounterMode counts them (2.15 counts more than 2.13)
    True
"""

from .picture import timeline_html, timeline_svg
from .process_group import FakeProcessGroupError, fake_ranks
from .recipe import Recipe, plan_step
from .step import Measured, measure_step
from .timeline import Timeline

__all__ = [
    "FakeProcessGroupError",
    "Measured",
    "Recipe",
    "Timeline",
    "fake_ranks",
    "measure_step",
    "plan_step",
    "timeline_html",
    "timeline_svg",
]
