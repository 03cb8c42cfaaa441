"""A real draw after a deferral whose own draws from that generator are pending (issue 20).

Eagerly the model's draws come first; after ``deferred()`` the generator is
where it was before the block, so a real draw then (PEFT's
``get_peft_model`` on a deferred base, a new head, ``torch.randn``) cannot
equal eager.  It warns, once per deferral, naming the op, the module being
built and the fix.  The reference is eager PyTorch: the values differ
exactly in these cases, and are equal in the others.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
import warnings

import pytest
import torch
import torch.nn as nn

from deferinit import PendingDrawsWarning, deferred, deferred_init
from deferinit.random import pending
from deferinit.fake import fake_mode
from deferinit.materialize import materialize_module


def _pending(record_warnings):
    return [w for w in record_warnings if issubclass(w.category, PendingDrawsWarning)]


def _build_then(after, *, materialize_first=False):
    """(eager, deferred) values of ``after()`` following a Linear(4, 4) built eagerly / deferred."""
    torch.manual_seed(0)
    nn.Linear(4, 4)
    eager = after()
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with deferred():
            m = nn.Linear(4, 4)
        if materialize_first:
            materialize_module(m)
        got = after()
        materialize_module(m)
    return eager, got, _pending(seen)


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 2)


@pytest.mark.parametrize(
    "after",
    [
        lambda: Head().proj.weight.detach(),
        lambda: torch.randn(3),
        lambda: torch.empty(3).uniform_(),
        lambda: torch.randint(0, 100, (3,)),
        lambda: torch.bernoulli(torch.full((5,), 0.5)),
    ],
    ids=["module", "randn", "uniform_", "randint", "bernoulli"],
)
def test_a_real_draw_while_draws_are_pending_warns_and_differs_from_eager(after):
    eager, got, seen = _build_then(after)
    assert not torch.equal(eager, got)  # why it warns: eagerly the model drew first
    assert len(seen) == 1
    message = str(seen[0].message)
    assert "default cpu generator" in message and "still deferred" in message
    assert "with deferred()" in message and "materialize_module" in message


def test_the_warning_names_the_module_built_and_the_deferral():
    with deferred():
        nn.Linear(2, 2)
        keep = nn.Linear(2, 2)
    with pytest.warns(PendingDrawsWarning) as seen:
        Head()
    message = str(seen[0].message)
    assert "constructing Head > Linear" in message and "deferred() at test_pending.py" in message
    assert "Tensor.uniform_" in message and "4 random draw(s)" in message
    del keep


@pytest.mark.parametrize("case", ["materialized first", "reseeded", "explicit generator"])
def test_no_warning_where_the_draw_equals_eager(case):
    def after():
        if case == "reseeded":
            torch.manual_seed(7)
        if case == "explicit generator":
            return torch.rand(3, generator=torch.Generator().manual_seed(1))
        return torch.rand(3)

    eager, got, seen = _build_then(after, materialize_first=case == "materialized first")
    assert not seen and torch.equal(eager, got)


def test_no_warning_for_draws_that_are_not_real():
    """Draws inside another deferral are recorded, draws in fake_mode make fakes, and
    PyTorch's FakeTensorMode and meta tensors draw from no generator (eager's stream
    after them is the one without them)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    torch.manual_seed(0)
    eager = (nn.Linear(4, 4), torch.rand(5))
    torch.manual_seed(0)
    with deferred():
        m = nn.Linear(4, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PendingDrawsWarning)
        with deferred():
            other = nn.Linear(4, 4)
        with fake_mode():
            nn.Linear(4, 4)
            torch.randn(3)
        with FakeTensorMode():
            outside = torch.empty(3, 3)
            nn.Linear(4, 4)
            torch.randn(3)
        outside.normal_()  # a FakeTensorMode fake, its mode no longer active
        with torch.device("meta"):
            nn.Linear(4, 4)
            torch.randn(3)
    materialize_module(m)
    assert torch.equal(m.weight, eager[0].weight) and torch.equal(torch.rand(5), eager[1])
    materialize_module(other)


def test_a_draw_on_a_deferred_tensor_naming_the_default_generator_equals_eager():
    """``w.uniform_(generator=torch.default_generator)`` on a deferred tensor after
    the block is recorded after the model's draws, as eagerly: no warning."""

    def build(defer):
        torch.manual_seed(0)
        if defer:
            with deferred():
                m = nn.Linear(4, 4)
        else:
            m = nn.Linear(4, 4)
        with torch.no_grad():
            m.weight.uniform_(generator=torch.default_generator)
        if defer:
            materialize_module(m)
        return m, torch.rand(3)

    (e, e_next) = build(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PendingDrawsWarning)
        (d, d_next) = build(True)
    assert torch.equal(e.weight, d.weight) and torch.equal(e.bias, d.bias) and torch.equal(e_next, d_next)


def _diverted() -> bool:
    return torch.rand is not torch._C._VariableFunctions.rand


def test_once_per_deferral_and_gone_with_the_record():
    users = pending.PATCHES[0].users
    with deferred():
        m = nn.Linear(2, 2)
    assert pending.PATCHES[0].users == users + 1  # diverted while the record may warn
    assert torch.Tensor.uniform_ is not torch._C.TensorBase.uniform_
    with pytest.warns(PendingDrawsWarning):
        torch.rand(2)
    # warned: it never will again, so nothing is diverted for it any more
    assert pending.PATCHES[0].users == users
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.rand(2)
    with deferred():
        other = nn.Linear(2, 2)
    assert pending.PATCHES[0].users == users + 1
    del other
    gc.collect()  # a record that never warned: released when it dies
    assert pending.PATCHES[0].users == users
    if users == 0:
        assert "uniform_" not in vars(torch.Tensor) and not _diverted()
    del m


@pytest.mark.parametrize("then", ["reseeded", "materialized", "generator set"])
def test_a_deferral_that_can_no_longer_warn_stops_diverting_draws(then):
    """Each real random call pays the check (microseconds: see
    benchmarks/patch_overhead.py) while a deferral may warn: only until it can
    no longer, not for as long as the record lives (a model kept deferred
    while another one trains)."""
    users = pending.PATCHES[0].users
    with deferred() as record:  # held: the record outlives its model's fakes
        m = nn.Linear(2, 2)
    g = torch.Generator().manual_seed(1)
    torch.rand(2, generator=g)  # a generator of the user's: the deferral may still warn
    assert pending.PATCHES[0].users == users + 1
    if then == "reseeded":
        torch.manual_seed(3)
    elif then == "materialized":
        materialize_module(m)  # hands the generator over, as eager construction left it
    else:
        torch.set_rng_state(torch.Generator().manual_seed(5).get_state())
    with warnings.catch_warnings():
        warnings.simplefilter("error", PendingDrawsWarning)
        torch.rand(2)  # equals eager: no warning, and the record is retired
    assert pending.PATCHES[0].users == users
    del record


def test_reseeding_to_the_same_seed_is_not_a_pending_draw():
    """A seed set since the deferral: eagerly it resets the generator too."""
    torch.manual_seed(0)
    with deferred():
        m = nn.Linear(2, 2)
    torch.manual_seed(0)  # the very state the deferral left
    with warnings.catch_warnings():
        warnings.simplefilter("error", PendingDrawsWarning)
        torch.rand(2)
    del m


def test_materialization_itself_does_not_warn():
    """Replay draws (trunc_normal_ re-run as a Python call included) never warn."""

    class Init(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.empty(8, 8))
            nn.init.trunc_normal_(self.w)
            self.l = nn.Linear(8, 8)

    torch.manual_seed(0)
    eager = Init()
    torch.manual_seed(0)
    m = deferred_init(Init)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        materialize_module(m)
    assert torch.equal(m.w, eager.w) and torch.equal(m.l.weight, eager.l.weight)


def test_a_draw_eager_refuses_raises_eagers_error():
    """The check never stands in the way: arguments eager refuses get eager's error."""
    with deferred():
        m = nn.Linear(2, 2)
    for call in (lambda f: f(3, device="no-such-device"), lambda f: f(-1), lambda f: f(2, generator=3)):
        with pytest.raises(Exception) as eager:
            call(torch._C._VariableFunctions.randn)
        with warnings.catch_warnings():
            warnings.simplefilter("error", PendingDrawsWarning)  # nothing was drawn: no warning
            with pytest.raises(type(eager.value)) as ours:
                call(torch.randn)
        assert str(ours.value) == str(eager.value)
    with pytest.warns(PendingDrawsWarning):  # the first real draw still says it
        torch.randn(2)
    del m


def test_recording_while_the_draws_are_diverted_equals_eager():
    """A second deferral recorded while the first one's draws are pending (the
    random methods of torch.Tensor diverted): both equal eager, in order."""

    def build():
        return nn.Sequential(nn.Linear(4, 4), nn.Embedding(5, 3))

    torch.manual_seed(0)
    first, second = build(), nn.Conv2d(2, 2, 3)
    eager_next = torch.rand(4)
    torch.manual_seed(0)
    with deferred():
        d_first = build()
    assert torch.Tensor.uniform_ is not torch._C.TensorBase.uniform_
    with deferred():
        d_second = nn.Conv2d(2, 2, 3)
    materialize_module(d_first)
    materialize_module(d_second)
    for a, b in ((first, d_first), (second, d_second)):
        assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert torch.equal(torch.rand(4), eager_next)


def test_a_draw_found_pending_warns_though_another_thread_moves_the_generator_first(monkeypatch):
    """A thread whose draw found the deferral pending warns after drawing; another
    thread drawing meanwhile sees the generator moved (nothing pending for it)
    and must not retire the deferral under the first one (its warning was lost)."""
    users = pending.PATCHES[0].users
    torch.manual_seed(0)
    with deferred():
        m = nn.Linear(2, 2)
    real_warn = pending._warn
    drawn, other_done = threading.Event(), threading.Event()

    def warn_later(*args):  # the first thread, between its draw and its warning
        drawn.set()
        other_done.wait(30)
        real_warn(*args)

    monkeypatch.setattr(pending, "_warn", warn_later)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        first = threading.Thread(target=torch.rand, args=(2,))
        first.start()
        assert drawn.wait(30)
        monkeypatch.setattr(pending, "_warn", real_warn)
        torch.rand(2)  # after the first thread's draw: as eagerly, no warning of its own
        other_done.set()
        first.join()
    assert len(_pending(seen)) == 1 and str(_pending(seen)[0].message).startswith("torch.rand draws")
    assert pending.PATCHES[0].users == users  # warned: retired
    del m


def test_deferrals_in_threads_hold_and_release_the_diversions_in_pairs():
    """Threads deferring, drawing, seeding and dropping models at once: every
    deferral warns at most once, and the diversions are held exactly while some
    deferral may warn (the count back where it was, PyTorch's functions back)."""
    users = pending.PATCHES[0].users
    start = threading.Barrier(6)
    errors = []

    def work(i):
        try:
            own = torch.Generator().manual_seed(i)
            start.wait(30)
            for round in range(8):
                with deferred():
                    m = nn.Linear(8, 8)
                action = (i + round) % 4
                if action == 0:
                    torch.rand(2)  # a real draw: pending for some deferral, or not
                elif action == 1:
                    torch.manual_seed(round)
                elif action == 2:
                    torch.rand(2, generator=own)  # never pending: keeps it watched
                else:
                    materialize_module(m)
                del m
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors
    assert len(_pending(seen)) <= 6 * 8
    gc.collect()
    assert pending.PATCHES[0].users == pending.PATCHES[1].users == users
    assert not pending._watched or users
    if users == 0:
        assert not _diverted() and "uniform_" not in vars(torch.Tensor)


def test_a_deferral_retired_by_another_thread_as_it_closes_releases_what_it_holds(monkeypatch):
    """Thread B seeds and draws while thread A's deferral is closing: B may retire
    A's record only once A holds the diversions, or B releases what A has not
    acquired yet."""
    users = pending.PATCHES[0].users
    with deferred():  # keeps the draws diverted, so that B's draw is checked
        first = nn.Linear(2, 2)
    patch, real_acquire = pending.PATCHES[0], pending.PATCHES[0].acquire
    calls, counts = [], []

    def reseed_and_draw():
        torch.manual_seed(1)
        torch.rand(2)

    def acquire(holder=None):  # A, closing its deferral: B seeds and draws now
        if not calls:
            calls.append(threading.Thread(target=reseed_and_draw))
            calls[0].start()
            calls[0].join(1)  # B waits for A's record to be held (or retires it now)
            counts.append(patch.users)
        return real_acquire(holder)

    monkeypatch.setattr(patch, "acquire", acquire)
    with deferred():
        second = nn.Linear(2, 2)
    monkeypatch.undo()
    calls[0].join()
    # B did not release what A had not acquired yet (the count went below the
    # holders: a third deferral would have found the draws not diverted)
    assert counts == [users + 1]
    torch.manual_seed(2)
    torch.rand(2)  # both deferrals can no longer warn: retired
    assert pending.PATCHES[0].users == pending.PATCHES[1].users == users
    del first, second
    gc.collect()
    assert pending.PATCHES[0].users == pending.PATCHES[1].users == users


def test_a_draw_under_a_device_context_is_checked_on_that_device():
    """``with torch.device("meta")``: the draw takes no CPU randomness, eagerly
    or here (no warning), and the CPU generator stays where eager leaves it."""

    def build(defer):
        torch.manual_seed(0)
        if defer:
            with deferred():
                m = nn.Linear(2, 2)
        else:
            m = nn.Linear(2, 2)
        with torch.device("meta"):
            x = torch.rand(3)
        if defer:
            materialize_module(m)
        return m, x, torch.rand(4)

    e, e_x, e_next = build(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PendingDrawsWarning)
        d, d_x, d_next = build(True)
    assert d_x.device == e_x.device and torch.equal(e.weight, d.weight) and torch.equal(e_next, d_next)


def test_the_diverted_random_functions_pickle_as_pytorchs_do():
    """By reference, to what ``torch.rand`` and ``torch.Tensor.uniform_`` are."""
    import pickle

    with deferred():
        m = nn.Linear(2, 2)
    assert torch.Tensor.uniform_ is not torch._C.TensorBase.uniform_
    for f in (torch.rand, torch.Tensor.uniform_, torch.Tensor.normal_):
        assert pickle.loads(pickle.dumps(f)) is f
    del m


_COLLECTED_UNDER_THE_LOCK = """
import gc
from torch import nn
from deferinit import deferred
from deferinit.random import pending

for lock in (pending._lock, pending.PATCHES[0]._lock):
    with deferred():
        m = nn.Linear(2, 2)
    users = pending.PATCHES[0].users
    cycle = [m]
    cycle.append(cycle)  # the record now dies only through the cyclic collector
    del m
    with lock:
        del cycle
        gc.collect()  # its finalizer runs here, in this thread, under the lock
    assert pending.PATCHES[0].users == users - 1, (pending.PATCHES[0].users, users)
print("ok")
"""


def test_a_record_collected_while_the_diversions_lock_is_held_does_not_deadlock():
    """A record in a reference cycle dies when the cyclic collector runs, which
    may be inside any allocation, also while this thread holds the lock of
    the watch or of a patch: its finalizer must not wait for that lock (it
    hung the checkpoint tests)."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    try:
        done = subprocess.run([sys.executable, "-c", _COLLECTED_UNDER_THE_LOCK], env=env, capture_output=True,
                              text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("deadlock: the finalizer waited for a lock its own thread held")
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_the_diverted_random_ops_are_every_aten_op_with_a_generator_argument():
    """random_ops() asks operator by operator; PyTorch's full schema list gives the same names."""
    names = {s.name[6:] for s in torch._C._jit_get_all_schemas()
             if s.name.startswith("aten::") and any(a.name == "generator" for a in s.arguments)}
    functions, methods = pending.random_ops()
    assert functions == tuple(sorted(n for n in names if callable(getattr(torch, n, None))))
    assert methods == tuple(sorted(n for n in names if callable(getattr(torch.Tensor, n, None))))
    assert {"randn", "rand_like", "randperm", "normal"} <= set(functions)
    assert {"uniform_", "normal_", "bernoulli_", "random_"} <= set(methods)


def test_the_first_deferral_holds_no_table_of_every_operator_schema():
    """Watching a deferral's draws looks up only the random ops' schemas, the first
    time a process needs them: its anonymous memory grows by far less than the
    5 MiB that parsing every operator schema keeps."""
    code = (
        "import torch\n"
        "import deferinit.random.pending as p\n"
        "assert not p._names\n"  # no deferral yet: nothing looked up
        "def anon():\n"
        "    return next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('RssAnon'))\n"
        "a = anon(); p.random_ops(); print(anon() - a)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert int(out.stdout.strip()) < 2048, out.stdout  # KiB


def test_deferrals_without_a_reseed_do_not_grow_the_lineage():
    """Each deferral names the generator's new state after the previous one (a
    chain): kept whole, it grew by an entry per deferral for the life of the
    process (tests/test_leaks.py caught its table resizing).  Names no record,
    generator or read state holds are now links only, shortened past."""
    from deferinit.random.record import LINEAGE

    for _ in range(3000):
        deferred_init(lambda: torch.empty(2).uniform_())
    assert len(LINEAGE._parent) <= 2100


def test_pending_draws_and_hand_over_when_every_name_is_pruned(monkeypatch):
    """The lineage shortened at every new name gives the same answers: a
    continued record, a reseed, a state read and set back (fork_rng), and the
    generator after materialization as eager's."""
    from deferinit.random import record as R

    prune = R.Lineage._prune

    def always(self, new):
        prune(self, new)
        self._prune_at = 0

    monkeypatch.setattr(R.Lineage, "_prune", always)
    monkeypatch.setattr(R.LINEAGE, "_prune_at", 0)

    def build():
        with torch.random.fork_rng():
            torch.rand(3)
        return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))

    torch.manual_seed(0)
    eager = [build(), build(), torch.rand(5)]
    torch.manual_seed(0)
    first = deferred_init(build)
    second = deferred_init(build)
    materialize_module(second)
    materialize_module(first)
    after = torch.rand(5)
    for e, d in zip(eager[:2], (first, second)):
        for (name, a), (_, b) in zip(e.state_dict().items(), d.state_dict().items()):
            assert torch.equal(a, b), name
    assert torch.equal(after, eager[2])

    torch.manual_seed(1)
    moot = deferred_init(build)
    torch.manual_seed(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PendingDrawsWarning)
        torch.rand(2)  # the reseed made moot's draws moot: no warning
    del moot
