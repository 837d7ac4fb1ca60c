"""deltas="auto": how a publisher picks between sending its changed chunks as XOR deltas or whole, from
the times its publishes took (revisions.SendChoice; the times are given here, the choice is the code's)."""

from __future__ import annotations

import pytest
import torch

from weightstream.client import WeightStreamClient
from weightstream.client.revisions import SEND_RETRY, SEND_RETRY_MOST, SEND_SAMPLES, SendChoice

GB = 10**9


def picks(choice: SendChoice, seconds: dict[bool, float], publishes: int) -> list[bool]:
    """What choice picks over publishes publishes of 1 GB, each taking seconds[the way it picked]."""
    picked = []
    for _ in range(publishes):
        encode = choice.encode()
        picked.append(encode)
        choice.record(encode, seconds[encode], GB)
    return picked


def test_both_ways_are_measured_first_then_the_faster_goes_on() -> None:
    picked = picks(SendChoice(), {True: 0.7, False: 0.5}, 6)
    assert picked == [True, False, False, False, False, False]
    picked = picks(SendChoice(), {True: 0.8, False: 3.6}, 6)
    assert picked == [True, False, True, True, True, True]


def test_the_slower_way_is_measured_again_less_often_the_more_it_lost_by() -> None:
    """Measured at publishes 0 and 1; then the slower way again once the faster went on SEND_RETRY times
    how many times slower the other was (at most SEND_RETRY_MOST times)."""
    assert (SEND_RETRY, SEND_RETRY_MOST) == (8, 8)
    close = picks(SendChoice(), {True: 0.55, False: 0.5}, 40)  # 1.1x: again after 9 (8.8) whole
    assert [i for i, encode in enumerate(close) if encode] == [0, 11, 21, 31]
    far = picks(SendChoice(), {True: 0.8, False: 3.6}, 80)  # 4.5x: again after 36 with deltas
    assert [i for i, encode in enumerate(far) if not encode] == [1, 38, 75]
    capped = picks(SendChoice(), {True: 0.5, False: 50.0}, 140)  # 100x: again after 64 (8 x 8)
    assert [i for i, encode in enumerate(capped) if not encode] == [1, 66, 131]


def test_a_way_that_became_faster_takes_over() -> None:
    choice = SendChoice()
    picks(choice, {True: 0.7, False: 0.5}, 2)  # whole is faster
    assert choice.encode() is False
    for _ in range(40):  # the link slowed down: whole now takes 3 s, deltas still 0.7 s
        encode = choice.encode()
        choice.record(encode, 0.7 if encode else 3.0, GB)
    assert choice.encode() is True


def test_one_slow_publish_does_not_turn_the_choice_but_a_lasting_change_does() -> None:
    """Each way is judged by the median of its last SEND_SAMPLES times: a publish slowed by a busy host
    (whole 0.5 s, once 3 s) leaves whole the choice; three slow ones in a row turn it."""
    assert SEND_SAMPLES == 5
    choice = SendChoice()
    picks(choice, {True: 0.7, False: 0.5}, 5)
    choice.record(False, 3.0, GB)
    assert choice.encode() is False
    choice.record(False, 3.0, GB)
    assert choice.encode() is False
    choice.record(False, 3.0, GB)
    assert choice.encode() is True


def test_the_slower_way_measured_again_is_judged_by_that_measurement_alone() -> None:
    """Deltas took 1.0 s five times against whole's 0.5 s; then the host got faster at encoding (0.3 s):
    the first time deltas is measured again, it takes over."""
    choice = SendChoice()
    for _ in range(5):
        choice.record(True, 1.0, GB)
    picked = picks(choice, {True: 0.3, False: 0.5}, 30)
    assert picked[:2] == [False, False]
    first = picked.index(True)
    assert first <= SEND_RETRY * 2 + 1, picked
    assert all(picked[first:]), picked


def test_publish_takes_true_false_or_auto_and_names_any_other_string() -> None:
    """Checked before anything is sent (no server at this address is ever reached)."""
    with WeightStreamClient("127.0.0.1:9", progress=False) as client:
        with pytest.raises(ValueError, match="deltas must be True, False or \"auto\", not 'yes'"):
            client.publish("m", {"w": torch.zeros(2)}, deltas="yes")  # type: ignore[arg-type]
