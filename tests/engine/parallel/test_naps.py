"""Naps: while rank 0 has no step to run, it sends the other ranks naps, never a plan, and they sleep
through them instead of polling in a collective; the wait for rank 0 after a nap is watched."""

from collections import deque
from contextlib import contextmanager

import mlx.core as mx
import pytest

from mlxkv.engine.parallel.follower import follow
from mlxkv.engine.parallel.naps import FIRST_NAP_S, Nap, Naps
from mlxkv.engine.parallel.rank_zero import RankZero
from mlxkv.engine.parallel.step_plan import PlanChannel
from mlxkv.errors import TensorParallelError


class Wire(PlanChannel):
    """A channel whose `receive` gets back, in order, what its `send` shared, then finds its peer lost."""

    def __init__(self, *messages):
        super().__init__(mx.distributed.init())  # a group of one
        self.shared, self.sent, self.sending = deque(), [], False
        for message in messages:
            self.send(message)

    def send(self, plan):
        self.sent.append(plan)
        self.sending = True
        super().send(plan)
        self.sending = False

    def _share(self, host):
        if self.sending:
            self.shared.append(host)
            return host
        if not self.shared:
            raise RuntimeError("[ring] connection to a peer was lost")  # what MLX raises
        return self.shared.popleft()


class Watchdog:
    """Records whether each receive was watched."""

    def __init__(self, channel):
        self.watching_now, self.receives = False, []
        original = channel.receive

        def receive():
            self.receives.append(self.watching_now)
            return original()

        channel.receive = receive

    @contextmanager
    def watching(self):
        self.watching_now = True
        yield
        self.watching_now = False


def test_naps_double_from_the_first_to_the_longest_and_start_short_after_a_step():
    naps = Naps(0.05)
    assert [naps.next() for _ in range(5)] == [Nap(FIRST_NAP_S), Nap(0.02), Nap(0.04), Nap(0.05), Nap(0.05)]
    naps.reset()
    assert naps.next() == Nap(FIRST_NAP_S)
    assert Naps(0).next() is None and Naps(0.004).next() == Nap(0.004)


@pytest.mark.parametrize("message", [Nap(0.25), Nap(0.001), None])
def test_a_nap_and_the_stop_cross_the_wire_unchanged_as_a_header_alone(message):
    wire = Wire(message)
    assert wire.receive() == message and wire.sent_bytes == 12 and not wire.shared


def rank_zero(longest_nap_s: float) -> RankZero:
    """Rank 0 of a group of one (nothing is sent: its channel is a `Wire`)."""
    rank_zero = RankZero(mx.distributed.init(), 60, longest_nap_s)
    rank_zero.channel = Wire()
    return rank_zero


def test_an_idle_rank_0_sends_naps_alone_and_waits_as_long_as_each():
    idle = rank_zero(0.04)
    assert [idle.rest() for _ in range(4)] == [FIRST_NAP_S, 0.02, 0.04, 0.04]
    assert idle.channel.sent == [Nap(FIRST_NAP_S), Nap(0.02), Nap(0.04), Nap(0.04)]
    idle.stop()


def test_rank_0_sends_nothing_while_idle_when_naps_are_off_or_the_group_failed():
    off, failed = rank_zero(0), rank_zero(0.5)
    failed.lose(TensorParallelError("gone"))
    assert off.rest() is None and failed.rest() is None
    assert off.channel.sent == failed.channel.sent == []
    off.stop()


def test_a_nap_to_a_lost_peer_fails_the_group():
    lost = rank_zero(0.5)
    lost.channel.send = lambda plan: lost.channel.receive()  # fails as a send to a lost peer does
    assert lost.rest() is None and "connection to a peer was lost" in str(lost.lost)


def test_a_follower_sleeps_through_each_nap_and_watches_its_wait_after_one():
    channel, slept = Wire(Nap(0.01), Nap(0.02), None), []
    watchdog = Watchdog(channel)
    follow(None, channel, watchdog, slept.append)
    assert slept == [0.01, 0.02] and watchdog.receives == [False, True, True]


def test_a_follower_whose_rank_0_is_gone_after_a_nap_ends_with_a_clear_error():
    channel = Wire(Nap(0.01))
    with pytest.raises(TensorParallelError, match=r"rank 0 of the tensor-parallel group is gone: .* peer was lost"):
        follow(None, channel, Watchdog(channel), lambda seconds: None)
