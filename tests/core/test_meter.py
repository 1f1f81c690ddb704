"""The live meter splits wall time among requests in flight; the charges add up to the busy time."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fairgate.core import CostModel
from fairgate.core.meter import LiveMeter, Occupancy
from fairgate.core.meter_reference import ReferenceMeter

COST = CostModel(9, 0.55, 0.06, 24)


def test_two_decoding_requests_split_evenly_and_prefill_weighs_more():
    meter = LiveMeter(COST, 0.0)
    meter.start("a", "ta", 400, 0.0)
    meter.first_token("a", 30.0)  # alone: all 30 ms are a's
    assert meter.charged_ms("a") == pytest.approx(30.0)
    meter.start("b", "tb", 400, 30.0)
    # a's iteration is still running: b waits for its boundary and is charged nothing meanwhile.
    meter.token(40.0)
    assert (meter.charged_ms("a"), meter.charged_ms("b")) == (pytest.approx(40.0), 0.0)
    meter.advance(50.0)  # b prefilling in the next iteration: it weighs more than a
    a, b = meter.charged_ms("a") - 40.0, meter.charged_ms("b")
    assert a + b == pytest.approx(10.0) and b > a
    step = COST.iteration_ms(2, 400)  # 9 + 0.55 x 2 ms of decode and b's 24 ms of prefill
    meter.first_token("b", 40.0 + step)
    # The step split by the charge rule: b its prefill and half the decode, a the other half.
    assert meter.charged_ms("b") == pytest.approx(24.0 + 10.1 / 2)
    assert meter.charged_ms("a") - 40.0 == pytest.approx(10.1 / 2)
    a, b = meter.charged_ms("a"), meter.charged_ms("b")
    meter.advance(40.0 + step + 20.0)
    assert meter.charged_ms("a") - a == pytest.approx(10.0)  # both decoding: dt / B each
    assert meter.charged_ms("b") - b == pytest.approx(10.0)


def test_idle_time_is_not_charged_and_backwards_clock_charges_nothing():
    meter = LiveMeter(COST, 0.0)
    meter.start("a", "t", 10, 100.0)  # idle before: not busy
    total = meter.finish("a", 110.0)
    assert total == pytest.approx(10.0) and meter.busy_ms == pytest.approx(10.0)
    meter.start("b", "t", 10, 200.0)
    meter.advance(150.0)
    assert meter.charged_ms("b") == 0.0 and meter.busy_ms == pytest.approx(10.0)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["start", "first", "token", "finish", "tick", "one_token", "cut", "depart"]),
            st.integers(0, 5),
            st.floats(0.0, 50.0),
            st.integers(0, 3000),
        ),
        max_size=60,
    )
)
def test_charges_sum_to_busy_time(events):
    meter = LiveMeter(COST, 0.0)
    now, live, leaving, finished_totals = 0.0, set(), set(), 0.0
    for kind, index, step, prompt in events:
        now += step
        rid = f"r{index}"
        if kind == "start" and rid not in live | leaving:
            meter.start(rid, f"t{index % 2}", prompt, now)
            live.add(rid)
        elif kind == "first" and rid in live:
            meter.first_token(rid, now)
        elif kind == "token":
            meter.token(now)
        elif kind in ("finish", "one_token") and rid in live:
            if kind == "one_token":  # its first token is its last (max_tokens = 1)
                meter.first_token(rid, now)
                now += step / 100.0
            finished_totals += meter.finish(rid, now)
            live.discard(rid)
        elif kind == "cut" and rid in live:
            left = meter.cut(rid, now)
            finished_totals += left.charged_ms if left is not None else 0.0
            (leaving.add if left is None else leaving.discard)(rid)
            live.discard(rid)
        elif kind == "depart" and rid in leaving:
            finished_totals += meter.depart(rid, now).charged_ms
            leaving.discard(rid)
        else:
            meter.advance(now)
        for rid, left in meter.departed:
            finished_totals += left.charged_ms
            leaving.discard(rid)
        meter.departed.clear()
    assert meter.leaving == len(leaving)
    in_flight = sum(meter.charged_ms(r) for r in live | leaving)
    assert finished_totals + in_flight == pytest.approx(meter.busy_ms, rel=1e-9, abs=1e-9)
    assert meter.charged_total_ms == pytest.approx(meter.busy_ms, rel=1e-9, abs=1e-9)
    assert all(c >= 0 for c in [finished_totals, in_flight])


EVENTS = ("start", "first", "token", "finish", "one_token", "cut", "depart", "tick", "remote", "occupancy", "scale")


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(EVENTS), st.integers(0, 6), st.floats(0.0, 60.0), st.integers(0, 4000), st.integers(1, 3)
        ),
        max_size=80,
    ),
    st.booleans(),
)
def test_the_integral_charges_what_charging_every_interval_charges(events, admits_after_burst):
    """Event by event, every request's charge, the busy and charged totals and the occupancy agree with the
    meter's definition (``fairgate.core.meter_reference``: each interval split by the weights it started with)."""
    meter, reference = LiveMeter(COST, 0.0), ReferenceMeter(COST, 0.0)
    meter.admits_after_burst = reference.admits_after_burst = admits_after_burst
    now, live, leaving, totals = 0.0, set(), set(), ([], [])
    for kind, index, step, prompt, n in events:
        now += step
        rid = f"r{index}"
        if kind == "start" and rid not in live | leaving:
            for m in (meter, reference):
                m.start(rid, f"t{index % 2}", prompt, now, sequences=n)
            live.add(rid)
        elif kind == "first" and rid in live:
            meter.first_token(rid, now)
            reference.first_token(rid, now)
        elif kind in ("finish", "one_token") and rid in live:
            if kind == "one_token":  # its first token is its last (max_tokens = 1): it may leave owing its prefill
                meter.first_token(rid, now)
                reference.first_token(rid, now)
                now += step / 100.0
            totals[0].append(meter.finish(rid, now))
            totals[1].append(reference.finish(rid, now)[1])
            live.discard(rid)
        elif kind == "cut" and rid in live:
            left, (_, expected) = meter.cut(rid, now), reference.cut(rid, now)
            assert (left is None, left.charged_ms if left else None) == (expected is None, pytest.approx(expected))
            (leaving.add if left is None else leaving.discard)(rid)
            live.discard(rid)
        elif kind == "depart" and rid in leaving:
            totals[0].append(meter.depart(rid, now).charged_ms)
            totals[1].append(reference.depart(rid, now)[1])
            leaving.discard(rid)
        elif kind == "remote":
            remote = Occupancy(float(n - 1) * step / 30.0, min(1.0, prompt / 8000.0))
            meter.set_remote(remote, now)
            reference.set_remote(remote, now)
        elif kind == "scale":  # the drift check's observed / predicted decode step
            meter.set_decode_scale(0.5 + step / 40.0, now)
            reference.set_decode_scale(0.5 + step / 40.0, now)
        elif kind == "occupancy":
            meter.advance(now)
            reference.advance(now)
            taken, expected = meter.take_occupancy(), reference.take_occupancy()
            assert taken.sequences == pytest.approx(expected.sequences, rel=1e-9, abs=1e-9)
            assert taken.prefill_share == pytest.approx(expected.prefill_share, rel=1e-9, abs=1e-9)
        else:
            for m in (meter, reference):
                if kind == "token":
                    m.token(now)
                else:
                    m.advance(now)
        departed = {rid: left.charged_ms for rid, left in meter.departed}
        assert departed == pytest.approx(dict(reference.departed), rel=1e-9, abs=1e-6)
        leaving -= set(departed)
        meter.departed.clear()
        reference.departed.clear()
        for r in live | leaving:
            assert meter.charged_ms(r) == pytest.approx(reference.charged_ms(r), rel=1e-9, abs=1e-6), (r, kind)
        assert (meter.prefilling, meter.sequences) == (reference.prefilling, reference.sequences)
    assert totals[0] == pytest.approx(totals[1], rel=1e-9, abs=1e-6)
    assert meter.busy_ms == pytest.approx(reference.busy_ms, rel=1e-12)
    assert meter.charged_total_ms == pytest.approx(reference.charged_total_ms, rel=1e-9, abs=1e-6)


def test_the_decode_scale_sets_the_decoding_sequences_part_of_an_iteration_that_prefills():
    """The drift check found decode steps twice the model's: in an iteration that also prefills a prompt of
    1,000 tokens (60 ms), a decoding sequence weighs 2 x (9 + 0.55 x 2) / 2 ms against the prompt's 60 + that."""
    meter = LiveMeter(COST, 0.0)
    meter.start("decoding", "a", 0, 0.0)
    meter.first_token("decoding", 1.0)
    meter.start("prefilling", "b", 1000, 10.0)
    meter.set_decode_scale(2.0, 15.0)
    meter.token(20.0)  # the boundary: the prompt joins the iteration
    before = meter.charged_ms("decoding")
    meter.advance(60.0)
    decode = 2.0 * (9 + 0.55 * 2) / 2
    assert meter.charged_ms("decoding") - before == pytest.approx(40.0 * decode / (decode + 60.0 + decode))
    assert meter.charged_total_ms == pytest.approx(meter.busy_ms)
    with pytest.raises(ValueError, match="decode scale must be within"):
        meter.set_decode_scale(0.0, 61.0)


def test_a_request_sent_mid_iteration_is_charged_only_from_the_next_boundary():
    meter = LiveMeter(COST, 0.0)
    meter.start("short", "a", 0, 0.0)
    meter.first_token("short", 10.0)  # a step has ended: the upstream is past its first iteration
    meter.start("long", "a", 2000, 10.0)
    meter.token(20.0)  # long joins here: 2000 x 0.06 = 120 ms of prefill in its iteration
    meter.start("late", "b", 2000, 30.0)  # sent during long's prefill iteration: pending
    meter.first_token("long", 150.0)
    meter.token(150.0)
    assert meter.charged_ms("late") == 0.0
    assert meter.charged_ms("short") + meter.charged_ms("long") == pytest.approx(150.0)
    meter.advance(280.0)  # late's prefill iteration: it carries the prefill weight
    assert meter.charged_ms("late") > 100.0


# --- several gateway processes on one replica (remote occupancy) -------------------------------------------------


def test_a_process_charges_only_its_part_of_an_iteration_it_shares_with_another_process():
    meter = LiveMeter(COST, 0.0)
    meter.start("a", "ta", 0, 0.0)
    meter.set_remote(Occupancy(sequences=3.0), 0.0)  # three decoding sequences of another process beside it
    meter.token(40.0)
    assert meter.charged_ms("a") == pytest.approx(10.0)  # dt / B with B = 4
    assert meter.busy_ms == pytest.approx(40.0) and meter.charged_total_ms == pytest.approx(10.0)
    # The other process spends a fifth of the time prefilling: that fifth is off, the rest split by B.
    meter.set_remote(Occupancy(sequences=3.0, prefill_share=0.2), 40.0)
    meter.token(140.0)
    assert meter.charged_ms("a") == pytest.approx(10.0 + 100.0 * 0.8 / 4)
    with pytest.raises(ValueError, match="remote occupancy"):
        meter.set_remote(Occupancy(-1.0, 0.0), 150.0)
    with pytest.raises(ValueError, match="remote occupancy"):
        meter.set_remote(Occupancy(1.0, 1.5), 150.0)


def test_occupancy_is_the_time_average_of_requests_in_the_iteration_and_the_prefill_share():
    meter = LiveMeter(COST, 0.0)
    meter.start("a", "t", 100, 0.0)  # alone: 100 x 0.06 = 6 ms of prefill in a 15.55-ms iteration
    meter.first_token("a", 20.0)
    meter.start("b", "t", 0, 20.0)  # pending until the next boundary
    meter.token(25.0)
    meter.advance(35.0)
    taken = meter.take_occupancy()  # 0-25 ms: 1 sequence; 25-35: 2
    assert taken.sequences == pytest.approx(45.0 / 35.0) and taken.prefill_share == pytest.approx(6.0 / 35.0)
    meter.advance(40.0)
    assert meter.take_occupancy() == Occupancy(2.0, 0.0)  # a new window
    assert meter.take_occupancy() == Occupancy(2.0, 0.0)  # a window of no time: the requests now


def _two_processes_on_one_replica(publish_every_ms: float | None, iterations: int = 3000):
    """A replica running continuous batching under the charge rule (the truth), fed by two gateway
    processes: process 0 sends short requests (20 tokens), process 1 long ones (300 tokens), all with
    400-token prompts, each keeping 8 sequences in flight. A request sent at a token's arrival reaches the
    replica during the next iteration and joins the one after. Each process meters its own requests, and
    every ``publish_every_ms`` the two swap their averaged occupancy (as ``ChargeSync`` rounds do; None:
    never). Returns ((truth, charged) of process 0, of process 1, replica busy time)."""
    meters = [LiveMeter(COST, 0.0), LiveMeter(COST, 0.0)]
    lengths = (20, 300)
    truth = [0.0, 0.0]
    running: list[dict[str, int]] = [{}, {}]  # per process: request -> tokens still to come
    joining: list[list[str]] = [[], []]  # arrived at the replica, joining the next iteration
    sent: list[list[str]] = [[], []]  # sent at the last token, arriving during the next iteration
    first_lengths: dict[str, int] = {}  # the first requests' lengths are staggered
    count = 0
    now = 0.0
    next_publish = publish_every_ms if publish_every_ms is not None else math.inf
    for side in (0, 1):
        for index in range(8):
            count += 1
            meters[side].start(f"{side}-{count}", f"t{side}", 400, now)
            joining[side].append(f"{side}-{count}")
            first_lengths[f"{side}-{count}"] = lengths[side] * (index + 1) // 8
    for _ in range(iterations):
        for side in (0, 1):
            running[side].update({name: first_lengths.get(name, lengths[side]) for name in joining[side]})
        batch = len(running[0]) + len(running[1])
        if not batch:  # every sequence ended at once: the replica idles until the next ones arrive
            joining, sent = sent, [[], []]
            continue
        dt = COST.decode_ms(batch) + COST.prefill_ms(400) * (len(joining[0]) + len(joining[1]))
        for side in (0, 1):
            truth[side] += COST.decode_ms(batch) / batch * len(running[side]) + COST.prefill_ms(400) * len(
                joining[side]
            )
        joining, sent = sent, [[], []]
        now += dt
        for side in (0, 1):
            meter = meters[side]
            for name, tokens in list(running[side].items()):
                meter.first_token(name, now) if tokens == first_lengths.get(name, lengths[side]) else meter.token(now)
                running[side][name] = tokens - 1
                if tokens == 1:
                    meter.finish(name, now)
                    del running[side][name]
                    count += 1
                    meter.start(f"{side}-{count}", f"t{side}", 400, now)
                    sent[side].append(f"{side}-{count}")
        if now >= next_publish:
            next_publish = now + publish_every_ms
            mine = [m.take_occupancy() for m in meters]
            meters[0].set_remote(mine[1], now)
            meters[1].set_remote(mine[0], now)
    return (truth[0], meters[0].charged_total_ms), (truth[1], meters[1].charged_total_ms), now


def test_two_processes_sharing_a_replica_each_charge_about_what_the_replica_spent_on_them():
    """The meters' split holds the charge rule to a few percent per process, and the two together bill the
    replica's busy time once (each alone would bill all of it: x2)."""
    (truth0, charged0), (truth1, charged1), busy_ms = _two_processes_on_one_replica(publish_every_ms=250.0)
    assert truth0 + truth1 == pytest.approx(busy_ms, rel=1e-9)
    assert charged0 == pytest.approx(truth0, rel=0.03) and charged1 == pytest.approx(truth1, rel=0.03)
    assert charged0 + charged1 == pytest.approx(busy_ms, rel=0.02)
    # Without the exchange each process bills every interval it has a request in: the replica's time twice.
    (_, alone0), (_, alone1), busy_ms = _two_processes_on_one_replica(publish_every_ms=None)
    assert alone0 + alone1 == pytest.approx(2 * busy_ms, rel=1e-6)


def test_a_token_of_the_burst_a_request_was_sent_in_is_not_its_iteration_boundary():
    """Found by the two-process simulation: a slot freed by a request ending in an iteration is taken at
    once, and the other tokens of that iteration, read after the new request was sent, made it join an
    iteration it was not in (prompt-heavy short requests over-billed by 12 %)."""
    meter = LiveMeter(COST, 0.0)
    for name in ("a", "b"):
        meter.start(name, "t", 0, 0.0)
    meter.token(20.0)  # an iteration ends: a's token ...
    meter.finish("a", 20.0)  # ... and a's end
    meter.start("c", "t", 1000, 20.2)  # a's slot taken at once
    meter.token(20.5)  # b's token of the same iteration, read a little later: not c's boundary
    meter.advance(40.0)
    assert meter.charged_ms("c") == 0.0
    meter.token(40.0)  # the next iteration ends: c joins the one after
    meter.advance(41.0)
    assert meter.charged_ms("c") > 0.5  # prefilling: most of the interval
    assert LiveMeter(COST, 0.0).boundary_lag_ms == pytest.approx(4.5)  # iter_base_ms / 2


# --- when a request joins an iteration: what a real engine showed (issue 13, llama-server) ------------------------

# llama-server's calibrated model (tests/engine): 6 + 2 B ms a step, 1.1 ms per prompt token; lag 3 ms.
ENGINE = CostModel(6.0, 2.0, 1.1, 8)


def test_requests_sent_before_an_idle_upstreams_first_token_share_its_first_iteration():
    """Found on llama-server: 1 request, then 7 of another tenant 2 ms later, all prefilled in one 1,345-ms
    step. Nothing has come back from the upstream since it went idle, so its first iteration has not ended,
    and every request sent meanwhile shares it: each is charged its part, not the first all of it."""
    meter = LiveMeter(ENGINE, 0.0)
    meter.start("first", "a", 150, 0.0)  # 150 x 1.1 = 165 ms of prefill each
    for index in range(7):
        meter.start(f"other{index}", "b", 150, 2.0)
    for name in ["first", *(f"other{i}" for i in range(7))]:
        meter.first_token(name, 1345.0)
    # 0-2 ms: the first alone. 2-1345 ms: eight equal weights (decode 22 / 8 + 165 prefill each).
    assert meter.charged_ms("first") == pytest.approx(2.0 + 1343.0 / 8, rel=1e-9)
    for index in range(7):
        assert meter.charged_ms(f"other{index}") == pytest.approx(1343.0 / 8, rel=1e-9)
    assert meter.charged_total_ms == pytest.approx(1345.0, rel=1e-12)
    # Once a token came back the upstream is no longer in its first iteration: a request sent now waits.
    meter.start("late", "c", 150, 1346.0)
    meter.advance(1360.0)
    assert meter.charged_ms("late") == 0.0


def _eight_decoding(meter: LiveMeter) -> None:
    """Eight requests decoding in 22-ms steps (the first token of each at 22 ms, then 44 ms)."""
    for index in range(8):
        meter.start(f"d{index}", "a", 0, 0.0)
    for index in range(8):
        meter.first_token(f"d{index}", 22.0)
    for _ in range(8):
        meter.token(44.0)


def _charge(finished: float | tuple[object, float]) -> float:
    return finished if isinstance(finished, float) else finished[1]


@pytest.mark.parametrize("own_token_first", [True, False])
@pytest.mark.parametrize("meter_kind", [LiveMeter, ReferenceMeter])
def test_a_request_that_makes_the_very_next_step_is_charged_its_prefill_at_its_first_token(own_token_first, meter_kind):
    """Found on llama-server: a request sent 0-15 ms after a step's tokens can still join the very next step.
    The meter cannot know at the send; it learns it when the request's first token arrives with that step's
    tokens (before, or among, the burst that ends it). The request was prefilled in a step charged to the
    others, and at its first token they give back its part of that step: it is billed its prefill at once, so
    a request whose first token is its last (max_tokens = 1) is too. Through an emulated replica, requests of
    one output token were billed 7 % under the replica's own charge rule when the meter charged the prefill back
    over the iterations after instead, which such a request is not in."""
    meter = meter_kind(ENGINE, 0.0)
    _eight_decoding(meter)
    meter.finish("d0", 44.0)  # its slot is free: a new request takes it 5 ms later (more than the 3-ms lag)
    meter.start("late", "b", 150, 49.0)
    end = 44.0 + 22.0 + 165.0  # the engine's next step: seven decoding and late's 165-ms prefill
    if own_token_first:  # pending until its own token: it joins then
        meter.first_token("late", end)
    for _ in range(7):  # else it joins at the burst, and its token read 0.5 ms later is of the same burst
        meter.token(end)
    if not own_token_first:
        meter.first_token("late", end + 0.5)
    now = end if own_token_first else end + 0.5
    # By seed 002's rule the step gives late its prefill and 22 / 8, each of the seven 22 / 8 (and 44 / 8 before).
    late = meter.charged_ms("late")
    assert late == pytest.approx(165.0 + 22.0 / 8, rel=0.01)
    others = [meter.charged_ms(f"d{i}") for i in range(1, 8)]
    assert others == pytest.approx([(now - 44.0 / 8 - late) / 7] * 7, rel=1e-9)  # alike, and all the rest
    assert others[0] == pytest.approx(44.0 / 8 + 22.0 / 8, rel=0.03)
    # Then decode only: 22 / 8 a step each; it leaves at its first token as well as after.
    meter.advance(now + 22.0)
    assert meter.charged_ms("late") - late == pytest.approx(22.0 / 8, rel=1e-9)
    assert _charge(meter.finish("late", now + 22.0)) == pytest.approx(late + 22.0 / 8, rel=1e-9)
    assert meter.charged_total_ms == pytest.approx(meter.busy_ms, rel=1e-12)


@pytest.mark.parametrize("meter_kind", [LiveMeter, ReferenceMeter])
def test_the_prefill_given_back_comes_from_what_the_others_were_charged_at_their_decode_weight(meter_kind):
    """An outside tester's case: P joins at a burst, R is sent 2 ms before it (pending), and the engine prefills
    both in the next step. The meter charged that step to P at its prefill weight until P's prefill was
    attributed, then to P and the decoders at their decode weight: what R gives back is what they were charged
    at their decode weight in it, in proportion, so P keeps its own prefill and the decoders are not stripped
    of steps before it (given back by weight now, d1 and d2 fell from 17.4 to 0.07 ms, P stayed at 298)."""
    meter = meter_kind(ENGINE, 0.0)
    for name in ("d1", "d2"):
        meter.start(name, "v", 0, 0.0)
    for name in ("d1", "d2"):
        meter.first_token(name, 10.0)
    for _ in ("d1", "d2"):
        meter.token(20.0)
    meter.start("P", "w", 150, 21.0)
    meter.start("R", "a", 150, 28.0)
    for _ in ("d1", "d2"):
        meter.token(30.0)
    end = 30.0 + ENGINE.iteration_ms(4, 300)  # 14 ms of decode, 330 of prefill
    for _ in ("d1", "d2"):
        meter.token(end)
    meter.first_token("P", end)
    meter.first_token("R", end)
    # The rule: P and R 165 + 14 / 4 each, d1 and d2 15 ms before the step and 14 / 4 in it.
    assert meter.charged_ms("R") == pytest.approx(168.5, rel=0.01)
    assert meter.charged_ms("P") == pytest.approx(168.5, rel=0.05)
    assert meter.charged_ms("d1") == meter.charged_ms("d2") == pytest.approx(18.5, abs=3.5)
    assert meter.charged_total_ms == pytest.approx(meter.busy_ms, rel=1e-12)


@pytest.mark.parametrize("meter_kind", [LiveMeter, ReferenceMeter])
def test_the_prefill_given_back_is_bounded_by_the_step_it_was_prefilled_in(meter_kind):
    """An outside tester's case: the engine read a late request's 3,000-token prompt from its prefix cache, and
    the step it was prefilled in took 18 ms, not the model's 3.3 s. What it is given back comes from that step
    alone (the model's whole prefill, given back at once, took 84 ms of charges from steps before it)."""
    meter = meter_kind(ENGINE, 0.0)
    decoders = ("d1", "d2", "d3")
    for name in decoders:
        meter.start(name, "v", 0, 0.0)
    for name in decoders:
        meter.first_token(name, 12.0)
    for _ in decoders:
        meter.token(24.0)
    meter.start("R", "a", 3000, 34.0)  # 2 ms before the burst that begins its step: pending at it
    for _ in decoders:
        meter.token(36.0)
    before = [meter.charged_ms(name) for name in decoders]
    end = 36.0 + ENGINE.iteration_ms(4) + 4.0  # 4 ms of its prompt not cached
    for _ in decoders:
        meter.token(end)
    meter.first_token("R", end)
    assert 0.0 < meter.charged_ms("R") <= end - 36.0
    assert all(meter.charged_ms(name) >= charged for name, charged in zip(decoders, before, strict=True))
    assert meter.charged_total_ms == pytest.approx(meter.busy_ms, rel=1e-12)


def test_a_first_token_a_whole_step_after_the_join_ends_the_prefill_as_before():
    """The usual case is unchanged: a request that missed the next step joins at that step's tokens, is
    prefilled in the one after, and its first token then ends its prefill weight."""
    meter = LiveMeter(ENGINE, 0.0)
    _eight_decoding(meter)
    meter.finish("d0", 44.0)
    meter.start("late", "b", 150, 45.0)
    meter.token(66.0)  # the step it missed ends: it joins the next one
    meter.first_token("late", 66.0 + 187.0)
    charged = meter.charged_ms("late")
    assert charged == pytest.approx(165.0 + 22.0 / 8, rel=1e-6)  # its step: 187 ms at 167.75 of 187
    meter.advance(66.0 + 187.0 + 22.0)
    assert meter.charged_ms("late") - charged == pytest.approx(22.0 / 8, rel=1e-6)


def _one_decoding_then_two_sent_just_before_a_burst(meter: LiveMeter | ReferenceMeter, second_prompt: int) -> float:
    """``v`` decodes alone in 8-ms steps; ``R`` (150-token prompt) and a second request are sent 1 and 0.5 ms
    before the burst at 24 ms: pending at it, yet the engine takes both into the step it begins, which prefills
    them. Returns when that step ends."""
    meter.start("v", "v", 0, 0.0)
    meter.first_token("v", 8.0)
    meter.token(16.0)
    meter.start("R", "a", 150, 23.0)
    meter.start("S", "w", second_prompt, 23.5)
    meter.token(24.0)
    return 24.0 + ENGINE.iteration_ms(3, 150 + second_prompt)


@pytest.mark.parametrize("meter_kind", [LiveMeter, ReferenceMeter])
def test_a_request_cut_mid_step_is_no_boundary(meter_kind):
    """An outside tester hung up on a request of its own mid-step: had its leaving ended the step, the pending
    request beside it would have joined there, its first token would not have been late, and its prefill would
    have stayed mostly with the others (billed 99 ms of 169)."""
    meter = meter_kind(ENGINE, 0.0)
    end = _one_decoding_then_two_sent_just_before_a_burst(meter, 1)
    assert _cut(meter, "S", 100.0) is None  # in the step: it stays until the step ends
    meter.token(end)
    meter.first_token("R", end)
    meter.advance(end + 3.0)
    assert meter.charged_ms("R") == pytest.approx(165.0 + 12.0 / 3, rel=0.01)  # its prefill, a third of the decode
    # S too pays for the step it was cut in (it joins it at the cut): its prefill and a part of the decode, not its
    # 12 / 3 to the ms: the meter, blind to R in the step until R's first token, split the step between S and v,
    # and R's prefill came back from both.
    [(name, charged)] = _departed(meter).items()
    assert name == "S" and 1.1 < charged < 1.1 + 12.0 / 3
    assert meter.charged_total_ms == pytest.approx(meter.busy_ms, rel=1e-12)


@pytest.mark.parametrize("meter_kind", [LiveMeter, ReferenceMeter])
def test_two_requests_late_in_one_burst_are_each_given_back_their_own_part(meter_kind):
    """An outside tester's case: the first of two late requests read was given a share of the step that the
    other's prefill swelled (a 1-token prompt billed 55 ms of a truth of 5, the other 123 of 169). Each is given
    back at most its own prefill and one decode step's share."""
    meter = meter_kind(ENGINE, 0.0)
    end = _one_decoding_then_two_sent_just_before_a_burst(meter, 1)
    meter.token(end)
    meter.first_token("S", end)
    meter.first_token("R", end)
    assert meter.charged_ms("S") == pytest.approx(1.1 + 12.0 / 3, rel=0.01)
    assert meter.charged_ms("R") == pytest.approx(165.0 + 12.0 / 3, rel=0.01)
    assert meter.charged_total_ms == pytest.approx(meter.busy_ms, rel=1e-12)


def _cut(meter: LiveMeter | ReferenceMeter, request_id: str, now_ms: float) -> float | None:
    """``cut``: its charge if it left at once, else None."""
    if isinstance(meter, ReferenceMeter):
        return meter.cut(request_id, now_ms)[1]
    left = meter.cut(request_id, now_ms)
    return None if left is None else left.charged_ms


def _departed(meter: LiveMeter | ReferenceMeter) -> dict[str, float]:
    if isinstance(meter, ReferenceMeter):
        return dict(meter.departed)
    return {request_id: left.charged_ms for request_id, left in meter.departed}


@pytest.mark.parametrize("meter_kind", [LiveMeter, ReferenceMeter])
@pytest.mark.parametrize("sent_ms", [23.0, 25.0])
def test_a_request_cut_while_pending_in_the_step_it_may_be_in_pays_for_that_step(meter_kind, sent_ms):
    """An outside tester sent long prompts 1-2 ms from a burst and hung up before the step they were prefilled
    in ended: pending at the meter, they were charged nothing (billed 0.61-0.67 of the replica's charge rule).
    Cut within the lag of the step's first token, before or after it, a request joins the step as at its first
    token, and stays in it until it ends (an engine takes aborts between steps): its prefill and decode share."""
    meter = meter_kind(ENGINE, 0.0)
    meter.start("v", "v", 0, 0.0)
    meter.first_token("v", 8.0)
    meter.token(16.0)
    if sent_ms > 24.0:
        meter.token(24.0)
    meter.start("R", "a", 150, sent_ms)  # the step that begins at 24 ms prefills it (165 ms)
    if sent_ms < 24.0:
        meter.token(24.0)
    assert _cut(meter, "R", 64.0) is None
    # Its weight in the step (165 + 10 / 2) beside what v weighed there (alone, 8): R 170 / 178 of the 40 ms.
    assert meter.charged_ms("R") == pytest.approx(40.0 * 170.0 / 178.0, rel=1e-9)
    end = 24.0 + ENGINE.iteration_ms(2, 150)
    meter.token(end)  # the step ends; R leaves once its burst is over (a late request's first token may follow)
    assert meter.leaving == 1 and _departed(meter) == {}
    assert meter.charged_ms("v") == pytest.approx(24.0 + 5.0, rel=0.03)
    meter.advance(end + 3.0)
    # The rule gives R 165 + 10 / 2 of the step, v 10 / 2 (and 24 ms alone before it).
    assert _departed(meter) == {"R": pytest.approx(170.0, rel=0.01)}
    assert meter.charged_total_ms == pytest.approx(meter.busy_ms, rel=1e-12)


@pytest.mark.parametrize("meter_kind", [LiveMeter, ReferenceMeter])
def test_a_request_cut_while_waiting_for_the_next_step_or_ending_pays_nothing_of_the_step(meter_kind):
    """Sent well after the running step began, a request waits for the next: aborted well before that one
    starts, it costs the engine nothing, and it leaves when that step starts. One that fails before any token is
    not charged the step either."""
    meter = meter_kind(ENGINE, 0.0)
    meter.start("v", "v", 0, 0.0)
    meter.first_token("v", 8.0)
    meter.token(16.0)
    meter.start("W", "a", 150, 30.0)  # 14 ms into the step that began at 16
    meter.start("F", "a", 150, 23.0)  # 1 ms before the next burst, as R above
    meter.token(24.0)
    assert _cut(meter, "W", 40.0) is None and meter.leaving == 1
    assert _charge(meter.finish("F", 40.0)) == 0.0
    meter.token(48.0)  # the step it waited for starts 8 ms after its abort
    assert _departed(meter) == {"W": 0.0} and meter.leaving == 0
    assert meter.charged_total_ms == pytest.approx(meter.busy_ms, rel=1e-12)


@pytest.mark.parametrize("meter_kind", [LiveMeter, ReferenceMeter])
def test_a_request_cut_early_in_its_prefill_pays_the_step_it_was_cut_in(meter_kind):
    """Cut 2 ms into the step that prefills it, a request was charged 2 ms of it and the others the rest, which
    the engine spent on its prompt all the same (the emulated replica charges it the step). It stays until the
    step's end: with a decoding request beside it, their next burst; alone, the caller's deadline
    (``step_left_ms``), by when the model's prefill has been attributed."""
    meter = meter_kind(ENGINE, 0.0)
    meter.start("v", "v", 0, 0.0)
    meter.first_token("v", 8.0)
    meter.start("R", "a", 150, 9.0)
    meter.token(16.0)  # R joins: its step prefills it
    assert _cut(meter, "R", 18.0) is None
    end = 16.0 + ENGINE.iteration_ms(2, 150)
    meter.token(end)
    meter.token(end + 10.0)
    assert _departed(meter) == {"R": pytest.approx(165.0 + 5.0, rel=1e-9)}

    alone = meter_kind(ENGINE, 0.0)
    alone.start("R", "a", 150, 0.0)
    assert _cut(alone, "R", 2.0) is None
    if isinstance(alone, LiveMeter):
        assert alone.step_left_ms() == pytest.approx(165.0 * (1 - 2.0 / 173.0) + 8.0, rel=1e-9)
        assert alone.depart("R", 173.0).charged_ms == pytest.approx(173.0, rel=1e-9)
    else:
        assert alone.depart("R", 173.0)[1] == pytest.approx(173.0, rel=1e-9)


@pytest.mark.parametrize("meter_kind", [LiveMeter, ReferenceMeter])
def test_a_request_sent_into_an_idle_upstreams_first_step_waits_for_the_next(meter_kind):
    """An outside tester's case: on an idle upstream, a request sent 100 ms into another's 1.1-s prefill was
    billed as a share of that step (78.7 ms of its own 67.5): the engine takes only what reaches it before its
    first step starts. Sent later than the lag, it waits for the next step, and pays the rule's 66 + 10 / 2."""
    meter = meter_kind(ENGINE, 0.0)
    meter.start("A", "a", 1000, 0.0)  # 1,100 ms of prefill, alone: its step ends at 1,108
    meter.start("B", "b", 60, 100.0)  # 66 ms of prefill
    meter.first_token("A", 1108.0)
    end = 1108.0 + ENGINE.iteration_ms(2, 60)
    meter.token(end)
    meter.first_token("B", end)
    assert meter.charged_ms("B") == pytest.approx(66.0 + 10.0 / 2, rel=1e-9)
    assert meter.charged_ms("A") == pytest.approx(1108.0 + 10.0 / 2, rel=1e-9)


@pytest.mark.parametrize("meter_kind", [LiveMeter, ReferenceMeter])
def test_a_request_an_idle_upstream_took_into_its_first_step_after_the_lag_is_given_its_prefill_back(meter_kind):
    """llama-server takes requests up to ~15 ms after a step's start. Sent 10 ms after the request that found the
    upstream idle (the lag here is 3 ms), it is pending at the meter, but its first token comes with that step's:
    it is given back its part of the step, from the first request's decode charges there."""
    meter = meter_kind(ENGINE, 0.0)
    meter.start("A", "a", 1000, 0.0)
    meter.start("B", "b", 60, 10.0)
    end = ENGINE.iteration_ms(2, 1060)  # 10 ms of decode and both prefills
    meter.first_token("A", end)
    meter.first_token("B", end)
    assert meter.charged_ms("B") == pytest.approx(66.0 + 10.0 / 2, rel=0.01)
    assert meter.charged_ms("A") == pytest.approx(1100.0 + 10.0 / 2, rel=0.01)
    assert meter.charged_total_ms == pytest.approx(meter.busy_ms, rel=1e-12)


@pytest.mark.parametrize("meter_kind", [LiveMeter, ReferenceMeter])
@pytest.mark.parametrize("admits_after_burst", [True, False])
def test_a_request_cut_just_after_its_send_after_a_burst_pays_as_the_engine_admits(meter_kind, admits_after_burst):
    """Sent 1 ms after a step's tokens and cut 2 ms later: an engine that takes such a request into the step it
    starts then (llama-server) prefills it; one that scheduled that step before the tokens went out (vLLM) never
    runs it, the abort reaching it 5 ms before the next step."""
    meter = meter_kind(ENGINE, 0.0)
    meter.admits_after_burst = admits_after_burst
    meter.start("v", "v", 0, 0.0)
    meter.first_token("v", 8.0)
    meter.token(16.0)
    meter.start("R", "a", 150, 17.0)
    assert _cut(meter, "R", 19.0) is None
    if admits_after_burst:
        assert meter.charged_ms("R") > 0.0  # its part of the step so far
    meter.token(24.0)
    meter.token(34.0)
    [(name, charged)] = _departed(meter).items()
    assert name == "R" and (charged > 0.0) is admits_after_burst


@pytest.mark.parametrize("meter_kind", [LiveMeter, ReferenceMeter])
def test_requests_cut_together_in_a_step_leave_when_it_ends_not_one_prefill_in(meter_kind):
    """An outside tester's case: four long prompts admitted in one step, cut 2 ms after it began. The step runs
    all four prefills; each left after its own (the cost model's end of its step, not the step's), and the
    decoders beside paid the rest (attacker 0.24-0.33 of the charge rule). The step's end by the model is what is
    left of every prefill in it; a burst ends it before that as before."""
    meter = meter_kind(ENGINE, 0.0)
    meter.start("v", "v", 0, 0.0)
    meter.first_token("v", 8.0)
    for index in range(4):
        meter.start(f"a{index}", "a", 150, 9.0)
    meter.token(16.0)  # they join: the step prefills all four (660 ms) and decodes five
    for index in range(4):
        assert _cut(meter, f"a{index}", 18.0) is None
    if isinstance(meter, LiveMeter):
        assert meter.step_left_ms() == pytest.approx(4 * 165.0 - 2.0 + 16.0, rel=0.01)
        assert meter.tokens_will_end_step and meter.in_step("a0")
    end = 16.0 + ENGINE.iteration_ms(5, 600)
    meter.token(end)
    meter.token(end + 10.0)
    departed = _departed(meter)
    assert sorted(departed) == [f"a{index}" for index in range(4)]
    assert all(charged == pytest.approx(165.0 + 16.0 / 5, rel=0.01) for charged in departed.values())


@pytest.mark.parametrize("meter_kind", [LiveMeter, ReferenceMeter])
def test_a_request_cut_just_before_a_step_ends_stays_for_the_next(meter_kind):
    """An outside tester's case: a long prompt sent just after a step's tokens and cut 1 ms before the next step's
    (its abort reaches the engine after that step took it in): it stayed only to that step's end and was billed
    12 ms of its 180 (0.29-0.55 of the charge rule). Cut closer than the lag to a step's end, a request stays
    for the step after, which prefills it."""
    meter = meter_kind(ENGINE, 0.0)
    meter.start("v", "v", 0, 0.0)
    meter.first_token("v", 8.0)
    meter.token(16.0)
    meter.start("R", "a", 150, 17.0)  # the next step begins at 24: it takes R in
    assert _cut(meter, "R", 23.0) is None
    meter.token(24.0)  # 1 ms after the cut: R stays
    assert meter.leaving == 1 and _departed(meter) == {}
    end = 24.0 + ENGINE.iteration_ms(2, 150)
    meter.token(end)
    meter.token(end + 10.0)
    assert _departed(meter) == {"R": pytest.approx(165.0 + 10.0 / 2, rel=0.05)}
    assert meter.charged_total_ms == pytest.approx(meter.busy_ms, rel=1e-12)


@pytest.mark.parametrize(
    ("cut_ms", "remote_prefill_share", "step_ms"), [(3.0, 0.0, 20.0), (30.0, 0.0, 20.0), (3.0, 0.5, 40.0)]
)
def test_a_request_cut_alone_in_its_process_beside_other_processes_stays_as_long_as_it_likely_ran(
    cut_ms, remote_prefill_share, step_ms
):
    """Outside testers' cases: on a gateway process with nothing else in flight, beside another process's
    requests, no token of its own can end a cut request's step. Kept for the cost model's whole step, quick
    cancels were billed their whole prefill (2.02 of the charge rule; most never ran); let go at the cut, prompts
    cut 30-300 ms after their send paid 0.69 of it. It stays for the step times the chance the replica took it
    in before its abort came: from send to cut over the replica's mean step, at most 1. That step is a decode step
    (20 ms at B = 7) lengthened by the others' prefill: at half the time prefilling, 40 ms. Sized by the decode
    step alone, cancels 1-5 ms after their send beside another process's prompts paid 2.4-5.1 of the charge rule
    (three seeds of 40, `bench/meter_cuts.py`), that process's tenants 0.93-0.94."""
    meter = LiveMeter(ENGINE, 0.0)
    meter.set_remote(Occupancy(6.0, remote_prefill_share), 0.0)
    meter.start("R", "a", 2000, 0.0)
    assert meter.cut("R", cut_ms) is None and not meter.tokens_will_end_step
    assert meter.leave_after_ms("R") == pytest.approx(meter.step_left_ms() * min(1.0, cut_ms / step_ms), rel=1e-9)
