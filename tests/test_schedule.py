"""Pipeline schedules as objects: order, dependencies, deadlock freedom, memory and makespan."""

from __future__ import annotations

import pytest

from alpa_torch.core.errors import PlanError
from alpa_torch.core.schedule import (
    BACKWARD,
    FORWARD,
    RECV_ACT,
    RECV_GRAD,
    SEND_ACT,
    SEND_GRAD,
    UPDATE,
    WEIGHT,
    DeadlockError,
    Instruction,
    PipelineSchedule,
    check_schedule,
    format_schedule,
    max_in_flight,
    schedule_named,
    schedule_names,
    simulate,
)

SIZES = [(s, b) for s in range(1, 9) for b in range(1, 17)]
SCHEDULES = ("gpipe", "1f1b", "zb-h1")
gpipe, one_f_one_b = schedule_named("gpipe").programs, schedule_named("1f1b").programs
zero_bubble = schedule_named("zb-h1")


def compute_order(program):
    return [(i.kind.value, i.microbatch) for i in program if i.is_compute]


def test_reprs_are_short():
    assert repr(Instruction(FORWARD, 1, 3)) == "F3"
    assert repr(Instruction(BACKWARD, 0, 0)) == "B0"
    assert repr(Instruction(SEND_ACT, 1, 4, 2)) == "sendA4:1->2"
    assert repr(Instruction(RECV_ACT, 2, 4, 1)) == "recvA4:1->2"
    assert repr(Instruction(SEND_GRAD, 2, 0, 1)) == "sendG0:2->1"
    assert repr(Instruction(RECV_GRAD, 1, 0, 2)) == "recvG0:2->1"
    assert repr(Instruction(UPDATE, 1)) == "U"


@pytest.mark.parametrize("bad", [
    dict(kind=SEND_ACT, stage=1, microbatch=0, peer_stage=0),  # activations go forward
    dict(kind=RECV_GRAD, stage=1, microbatch=0),  # receive without a peer
    dict(kind=FORWARD, stage=0, microbatch=0, peer_stage=1),
    dict(kind=UPDATE, stage=0, microbatch=2),
    dict(kind=FORWARD, stage=0),
])
def test_instruction_validation(bad):
    with pytest.raises(ValueError):
        Instruction(**bad)


def test_instruction_is_hashable_and_accepts_string_kind():
    assert Instruction("F", 0, 1) == Instruction(FORWARD, 0, 1)
    assert len({Instruction(FORWARD, 0, 1), Instruction("F", 0, 1)}) == 1


def test_gpipe_order_matches_torch_schedule_gpipe():
    # ScheduleGPipe: forwards 0..B-1, then backwards 0..B-1 (same order on every stage).
    for program in gpipe(3, 4):
        assert compute_order(program) == [("F", m) for m in range(4)] + [("B", m) for m in range(4)]
        assert program[-1].kind == UPDATE


def test_one_f_one_b_order_small_case():
    sched = one_f_one_b(4, 6)
    assert format_schedule(sched).splitlines()[0].startswith("stage 0: F0 sendA0:0->1 F1")
    expect_stage0 = ["F0", "F1", "F2", "F3", "B0", "F4", "B1", "F5", "B2", "B3", "B4", "B5"]
    expect_stage3 = ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3", "F4", "B4", "F5", "B5"]
    assert [f"{k}{m}" for k, m in compute_order(sched[0])] == expect_stage0
    assert [f"{k}{m}" for k, m in compute_order(sched[3])] == expect_stage3
    # Communication sits next to the compute it feeds or drains.
    assert [repr(i) for i in sched[1][:3]] == ["recvA0:0->1", "F0", "sendA0:1->2"]


def torch_1f1b_order(stage, num_stages, num_microbatches):
    """Compute order of torch.distributed.pipelining.Schedule1F1B, transcribed from its loop."""
    warmup = min(num_microbatches, num_stages - stage)
    order = [("F", m) for m in range(warmup)]
    fwd, bwd = warmup, 0
    while True:
        order.append(("B", bwd))
        bwd += 1
        if fwd == num_microbatches:
            break
        order.append(("F", fwd))
        fwd += 1
    order += [("B", m) for m in range(bwd, num_microbatches)]
    return order


@pytest.mark.parametrize("s,b", [(s, b) for s, b in SIZES if b >= s])  # torch requires B >= S
def test_one_f_one_b_matches_torch_order(s, b):
    for k, program in enumerate(one_f_one_b(s, b)):
        assert compute_order(program) == torch_1f1b_order(k, s, b)


@pytest.mark.parametrize("name", SCHEDULES)
def test_deadlock_free_and_dependencies_hold(name):
    for s, b in SIZES:
        sched = schedule_named(name).programs(s, b)
        check_schedule(sched)
        timeline = simulate(sched, fwd_s=1.0, bwd_s=2.0, comm_s=0.5)
        for k in range(s):
            for m in range(b):
                f, bw = timeline.event(FORWARD, k, m), timeline.event(BACKWARD, k, m)
                assert f.end_s <= bw.start_s
                if k > 0:  # the previous stage's forward of m finished before this one starts
                    assert timeline.event(FORWARD, k - 1, m).end_s + 0.5 <= f.start_s
                if k < s - 1:
                    assert timeline.event(BACKWARD, k + 1, m).end_s + 0.5 <= bw.start_s


def test_in_flight_peaks():
    for s, b in SIZES:
        for k, (g, o) in enumerate(zip(gpipe(s, b), one_f_one_b(s, b))):
            assert max_in_flight(g) == b
            assert max_in_flight(o) == min(s - k, b)
            # what the stage DP and the plan read: the same count, from the stages after k
            assert schedule_named("gpipe").in_flight(s - 1 - k, b) == b
            assert schedule_named("1f1b").in_flight(s - 1 - k, b) == min(s - k, b)


@pytest.mark.parametrize("name", ("gpipe", "1f1b"))
def test_unit_cost_makespan_is_analytic(name):
    # GPipe (and 1F1B, whose bubble is the same) take (B + S - 1)(f + b) with free comm.
    for s, b in SIZES:
        for f, bw in [(1.0, 1.0), (1.0, 2.0)]:
            timeline = simulate(schedule_named(name).programs(s, b), fwd_s=f, bwd_s=bw)
            assert timeline.makespan_s == pytest.approx((b + s - 1) * (f + bw))
            assert timeline.makespan_s == pytest.approx(schedule_named(name).step_time([f + bw] * s, b))
            assert timeline.idle_fraction == pytest.approx(schedule_named(name).bubble_fraction(s, b))


def test_zero_bubble_h1_splits_every_backward_and_keeps_one_f_one_b_memory():
    for s, b in SIZES:
        programs = zero_bubble.programs(s, b)
        for zb, ofob in zip(programs, one_f_one_b(s, b)):
            kinds = [i.kind for i in zb]
            assert kinds.count(WEIGHT) == kinds.count(BACKWARD) == b
            assert max_in_flight(zb) <= min(s, b)  # until the weight part
            waiting = peak = 0
            for i in zb:  # until the backward: 1F1B's count
                waiting += (i.kind == FORWARD) - (i.kind == BACKWARD)
                peak = max(peak, waiting)
            assert peak == max_in_flight(ofob)
        assert zero_bubble.in_flight(s - 1, b) == schedule_named("1f1b").in_flight(s - 1, b)
        assert zero_bubble.splits_backward(s, b) and not schedule_named("1f1b").splits_backward(s, b)


def test_zero_bubble_h1_step_is_a_third_of_one_f_one_b_bubble():
    """Equal forward, backward and weight times: ZB-H1's step is B t + (S - 1) t / 3 (1F1B's (B + S - 1) t)
    once B >= S, its formula (``step_time``) and simulation agree, and it is never slower than 1F1B."""
    for s, b in SIZES:
        zb = simulate(zero_bubble.programs(s, b), fwd_s=1.0, bwd_s=1.0, weight_s=1.0)
        ofob = simulate(one_f_one_b(s, b), fwd_s=1.0, bwd_s=2.0)
        assert zb.makespan_s <= ofob.makespan_s
        if b >= s:
            assert zb.makespan_s == pytest.approx(3 * b + s - 1)
            assert zb.makespan_s == pytest.approx(zero_bubble.step_time([3.0] * s, b))
            assert zb.idle_fraction == pytest.approx(zero_bubble.bubble_fraction(s, b))
    # the bar: at 4 microbatches, at most half of 1F1B's bubble
    assert zero_bubble.bubble_fraction(2, 4) <= schedule_named("1f1b").bubble_fraction(2, 4) / 2


def test_costs_split_a_stage_time_as_the_schedule_runs_it():
    times = [3.0, 6.0]
    assert schedule_named("1f1b").costs(times, 2, 4) == {"fwd_s": [1.0, 2.0], "bwd_s": [2.0, 4.0],
                                                         "weight_s": [0.0, 0.0]}
    # the first stage sends nothing back: all its backward is the weight part
    assert zero_bubble.costs(times, 2, 4) == {"fwd_s": [1.0, 2.0], "bwd_s": [0.0, 2.0], "weight_s": [2.0, 2.0]}


def test_check_schedule_rejects_a_weight_part_before_its_backward():
    program = zero_bubble.programs(1, 2)[0]
    swapped = [Instruction(WEIGHT, 0, 0) if i.kind == BACKWARD and i.microbatch == 0 else
               Instruction(BACKWARD, 0, 0) if i.kind == WEIGHT and i.microbatch == 0 else i for i in program]
    with pytest.raises(ValueError, match="WEIGHT after its BACKWARD"):
        check_schedule([swapped])
    with pytest.raises(ValueError, match="WEIGHT"):
        check_schedule([[i for i in program if not (i.kind == WEIGHT and i.microbatch == 1)]])


def test_comm_latency_adds_per_hop():
    # Each of the S-1 hops is crossed twice on the critical path (activation, gradient).
    timeline = simulate(gpipe(4, 1), fwd_s=1.0, bwd_s=1.0, comm_s=0.25)
    assert timeline.makespan_s == pytest.approx(8 + 2 * 3 * 0.25)


def test_per_stage_costs_and_bottleneck():
    # The slowest stage sets the pace: B max(t_j) <= T <= sum(t_i) + (B - 1) max(t_j) (Alpa eq. 2,
    # an upper estimate: here the fast neighbours' work overlaps the slow stage's).
    s, b = 3, 8
    fwd, bwd = [1.0, 3.0, 1.0], [1.0, 3.0, 1.0]
    timeline = simulate(one_f_one_b(s, b), fwd_s=fwd, bwd_s=bwd)
    stage_t = [f + w for f, w in zip(fwd, bwd)]
    assert b * max(stage_t) <= timeline.makespan_s <= sum(stage_t) + (b - 1) * max(stage_t)
    assert timeline.makespan_s == pytest.approx(50.0)


def test_deadlock_is_detected():
    sched = gpipe(2, 2)
    # Stage 1 waits for microbatch 1's activation before stage 0 ever sends it.
    sched[1] = [Instruction(RECV_ACT, 1, 1, 0)] + [i for i in sched[1] if repr(i) != "recvA1:0->1"]
    sched[0] = [Instruction(RECV_GRAD, 0, 0, 1)] + [i for i in sched[0] if repr(i) != "recvG0:1->0"]
    with pytest.raises(DeadlockError, match="deadlock"):
        simulate(sched)


def test_unreceived_send_is_an_error():
    sched = gpipe(2, 1)
    sched[1] = [i for i in sched[1] if i.kind != RECV_ACT]
    with pytest.raises(ValueError):
        simulate(sched)
    with pytest.raises(ValueError):
        check_schedule(sched)


def test_check_schedule_rejects_backward_before_forward():
    sched = gpipe(1, 2)
    sched[0] = [sched[0][2], sched[0][0], sched[0][1], sched[0][3], sched[0][4]]  # B0 F0 F1 B1 U
    with pytest.raises(ValueError, match="microbatch 0"):
        check_schedule(sched)


def test_bad_sizes():
    with pytest.raises(ValueError):
        gpipe(0, 4)
    with pytest.raises(ValueError):
        one_f_one_b(2, 0)


def test_schedules_are_registered_by_name_and_an_unknown_name_is_refused():
    assert set(SCHEDULES) <= set(schedule_names())
    assert schedule_named("1f1b").compute_order(2, 2) == [[("F", 0), ("F", 1), ("B", 0), ("B", 1)],
                                                           [("F", 0), ("B", 0), ("F", 1), ("B", 1)]]
    with pytest.raises(PlanError, match="unknown.*1f1b"):
        schedule_named("zero-bubble-v9")


class Reversed(PipelineSchedule):
    """A toy schedule for the tests: GPipe whose backwards run in reverse microbatch order (every
    microbatch's activations held, as GPipe)."""

    name = "test-reversed-gpipe"

    def order(self, stage, num_stages, num_microbatches):
        mbs = range(num_microbatches)
        return [(FORWARD, mb) for mb in mbs] + [(BACKWARD, mb) for mb in reversed(mbs)]


def test_a_new_schedule_is_one_class():
    """Defined here, nowhere else: registered, its programs valid, its memory and step time derived."""
    toy = schedule_named(Reversed.name)
    for s, b in SIZES[:40]:
        check_schedule(toy.programs(s, b))
        assert toy.in_flight(s - 1, b) == b
    assert toy.step_time([1.0, 3.0], 4) == 4.0 + 3 * 3.0
