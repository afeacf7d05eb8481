"""A decode's share of a batch planned for several decodes, read from the one plan
(kvplan.transport.senders.staged.share_of): the same descriptors, rows and sections as that share
planned on its own, on fresh random batches."""

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from kvplan.planner.contract.batch import Batch
from kvplan.planner.device import eager
from kvplan.tools.scenarios import build_batch, materialize
from kvplan.transport.senders.planned import PlannedBatch
from kvplan.transport.senders.staged import _planned_again, share_of
from tests.transport.handoff import HYBRID


@pytest.mark.parametrize("seed", [1, 2])
def test_a_share_read_from_the_plan_equals_the_share_planned_alone(seed):
    rng = np.random.default_rng(seed)
    lens = [int(x) for x in rng.integers(8, 48, size=5)]
    one = build_batch(HYBRID, 5, lens, chunks=2, prefix_len=0, seed=seed)
    src, _ = materialize(one.src, "cpu", seed=seed)
    dsts = tuple(materialize(replace(one.dsts[0]), "cpu")[0] for _ in range(2))
    dest_of = {r: int(rng.integers(0, 2)) for r in {t.request for t in one.transfers}}
    dest_of[one.transfers[0].request] = 0
    dest_of[one.transfers[-1].request] = 1  # (both decodes have a share)
    transfers = tuple(replace(t, dest=dest_of[t.request]) for t in one.transfers)
    batch = Batch(src, tuple(replace(d, req_to_token=one.dsts[0].req_to_token) for d in dsts), transfers)
    pending = eager.plan(batch)
    descs, per_transfer = pending.descriptors()
    planned = PlannedBatch(transfers, descs, per_transfer, pending.sections(), pending.device_descriptors())
    ep = SimpleNamespace(side=batch.src, peers=[SimpleNamespace(side=d) for d in batch.dsts], policy=batch.policy)
    for dest in (0, 1):
        read, alone = share_of(ep, planned, pending, batch, dest), _planned_again(ep, planned, batch, dest)
        assert [t.request for t in read.transfers] == [t.request for t in alone.transfers]
        assert all(t.dest == 0 for t in read.transfers)
        np.testing.assert_array_equal(read.descs, alone.descs)
        np.testing.assert_array_equal(read.per_transfer, alone.per_transfer)
        assert read.sections == alone.sections
        np.testing.assert_array_equal(read.device_descs.numpy(), alone.device_descs.numpy())


def _run(base_id, waves, dest):
    """A staged run reduced to what taking credits reads: its peer (no secret: every note opens), its
    waves' ids and the waves it posted."""
    from kvplan.transport.senders.staged import StagedRun

    run = object.__new__(StagedRun)
    run.peer = SimpleNamespace(opened=lambda raw: raw, credits_by_engine=True)
    run.base_id, run.waves, run.dest, run.trace = base_id, [object()] * waves, dest, None
    run.posted = {k: (SimpleNamespace(slot=k), None) for k in range(waves)}
    run.acked, run.remote_free = set(), [False] * waves
    run.ep = SimpleNamespace(verbs=None)
    return run


def test_credits_read_once_for_two_runs_reach_the_run_whose_waves_they_name():
    """Without a secret a credit opens for every run: the wave it names says whose it is. (A run that took
    another's credit left that run waiting for it until its deadline.)"""
    from kvplan.transport.senders.staged import route_notes
    from kvplan.transport.waves import credit_note

    first, second = _run(0, 2, dest=0), _run(2, 2, dest=1)
    notes = [("b", credit_note(3)), ("a", credit_note(0)), ("b", credit_note(2))]
    engine = SimpleNamespace(notifications=lambda: list(notes))
    for run in (first, second):
        run.own_notes = False
    assert route_notes(SimpleNamespace(runs=[first, second], engine=engine))
    assert first.acked == {0} and second.acked == {0, 1}
