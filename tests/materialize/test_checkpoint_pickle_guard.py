"""The one pickle guard (materialize/checkpoint/pickle_scan.py) remembers the small
pickles it passed, as long as the globals torch allows are those they passed
against: a distributed checkpoint's chunks repeat a few pickles hundreds of times.
"""

from __future__ import annotations

import collections
import pickle

import pytest
import torch

from deferinit.materialize.checkpoint import pickle_scan


class Odd:
    """A class a user allows with torch.serialization.add_safe_globals."""


def _counting(monkeypatch) -> list:
    walks = []
    real = pickle_scan._walk

    def spy(data, names):
        walks.append(data)
        return real(data, names)

    monkeypatch.setattr(pickle_scan, "_walk", spy)
    return walks


def test_a_pickle_that_passed_is_not_walked_again(monkeypatch):
    data = pickle.dumps(collections.OrderedDict(a=(1, 2)), protocol=2)
    walks = _counting(monkeypatch)
    for _ in range(3):
        pickle_scan.guard(data)
    assert walks.count(data) <= 1  # at most once (not at all if an earlier test passed it)


def test_a_refused_pickle_is_refused_every_time(monkeypatch):
    data = pickle.dumps(pickle.Pickler, protocol=2)
    for _ in range(2):
        with pytest.raises(pickle_scan.ScanError, match="does not allow"):
            pickle_scan.guard(data)


def test_what_passed_against_a_users_safe_globals_is_refused_once_they_are_cleared():
    data = pickle.dumps(Odd, protocol=2)
    before = torch.serialization.get_safe_globals()
    try:
        torch.serialization.add_safe_globals([Odd])
        pickle_scan.guard(data)
        torch.serialization.clear_safe_globals()
        with pytest.raises(pickle_scan.ScanError, match="Odd, which load_checkpoint does not allow"):
            pickle_scan.guard(data)
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)
