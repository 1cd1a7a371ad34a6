"""Two boxes (planner/two_boxes.py): the network link between them in the profile, a
cross-box layout's handoffs crossing it in the simulator, and the comparison of two
independent boxes with a cross-box split, on hand-made profiles whose answer is plain."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hand_profiles import hand_profile

from appliance.core.goodput import SLO
from appliance.planner.analytic import NETWORK_EFFICIENCY, analytic_profile, network_link
from appliance.planner.layout import Layout, Pool
from appliance.planner.plan_cli import main, sharegpt_like
from appliance.planner.profile import (
    HandoffCost,
    Profile,
    StepCost,
    WorkerCost,
    load_profile,
)
from appliance.planner.sim_box import Contention
from appliance.planner.simulator import SimRequest, simulate
from appliance.planner.two_boxes import (
    CROSS_BOX,
    TIE,
    TWO_BOXES,
    alternate,
    compare_two_boxes,
    cross_box_layouts,
    table,
)

KV_BYTES = 1000
HANDOFF = HandoffCost(base_s=0.003, per_byte_s=1e-8)
FAST_WORKER = WorkerCost(
    prefill=StepCost(base_s=0.01, per_token_s=0.001),
    decode=StepCost(base_s=0.02),
    mixed=StepCost(base_s=0.03, per_token_s=0.001),
    kv_blocks=4096,
)
# Prompts cost 0.5 ms a token, decodes 2 ms a step, but a step mixing a prompt chunk with
# decodes takes a second: a box that both prefills and decodes misses a 20 ms TPOT
# whenever prompts meet decodes; a box of prefill beside a box of decode never does.
INTERFERING = WorkerCost(
    prefill=StepCost(base_s=0.001, per_token_s=0.0005),
    decode=StepCost(base_s=0.002),
    mixed=StepCost(base_s=1.0, per_token_s=0.0005),
    kv_blocks=10_000,
)


def linked_profile(
    network: HandoffCost | None = None,
    atoms: int = 2,
    workers: dict[str, WorkerCost] | None = None,
) -> Profile:
    """A box of fast workers and slow handoffs, with `network` the link to its twin."""
    workers = workers or {"1x1": FAST_WORKER}
    return hand_profile(
        workers, atoms=atoms, kv_bytes_per_token=KV_BYTES, handoff=HANDOFF, network=network
    )


def split(prefill: int = 1, decode: int = 1, cross_box: bool = True) -> Layout:
    return Layout(
        mode="disaggregated",
        prefill=Pool(workers=prefill),
        decode=Pool(workers=decode),
        cross_box=cross_box,
    )


# ------------------------------------------------------------------ the link


def test_the_link_takes_bits_at_its_achievable_share_of_line_rate() -> None:
    link = network_link(400, latency_us=1500)
    assert link.per_byte_s == pytest.approx(8 / 400e9 / NETWORK_EFFICIENCY)
    assert link.base_s == pytest.approx(0.0015)
    # 1 GB at 400 Gb/s is 20 ms at line rate, 25 ms at 0.8 of it
    assert link.seconds(10**9) == pytest.approx(0.0015 + 0.025)
    assert network_link(100).per_byte_s == pytest.approx(4 * link.per_byte_s)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"gbps": 0}, "finite positive speed"),
        ({"gbps": -400}, "finite positive speed"),
        ({"gbps": math.inf}, "finite positive speed"),
        ({"gbps": math.nan}, "finite positive speed"),
        ({"gbps": 400, "latency_us": -1}, "latency"),
        ({"gbps": 400, "efficiency": 1.5}, "efficiency"),
    ],
)
def test_a_bad_link_is_a_clear_error(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        network_link(**kwargs)


def test_an_analytic_profile_takes_its_link_from_a_speed_and_says_so() -> None:
    plain = analytic_profile("a100-80gb-sxm", 8, "opt-13b")
    assert plain.network is None
    linked = analytic_profile("a100-80gb-sxm", 8, "opt-13b", link_gbps=400)
    assert linked.network == network_link(400)
    assert "400 Gb/s" in "\n".join(linked.assumptions)
    assert linked.workers == plain.workers and linked.handoff == plain.handoff


def test_a_profile_saved_before_the_link_still_loads(tmp_path: Path) -> None:
    path = linked_profile().save(tmp_path)
    data = json.loads(path.read_text())
    del data["network"]  # as an older appliance wrote it
    path.write_text(json.dumps(data))
    assert load_profile(path).network is None
    linked = linked_profile(network_link(400))
    assert load_profile(linked.save(tmp_path / "linked")) == linked


# ------------------------------------------------------------------ cross-box layouts


def test_a_cross_box_layout_is_a_split_labelled_box_by_box() -> None:
    layout = Layout(
        mode="disaggregated", prefill=Pool(workers=8), decode=Pool(workers=4, tp=2), cross_box=True
    )
    assert layout.label == "[8P]+[4D(tp2)]"
    assert layout.devices == 16
    assert layout.model_dump()["cross_box"] is True
    assert "cross_box" not in split(cross_box=False).model_dump()  # one box: as before
    with pytest.raises(ValueError, match="cross-box layout is disaggregated"):
        Layout(mode="colocated", prefill=Pool(workers=2), cross_box=True)


def test_a_cross_box_handoff_costs_the_links_time() -> None:
    # One request alone: its first token is the prefill box's (TTFT does not move); its
    # second comes the handoff's time after, so the link's time replaces the box's.
    slow = HandoffCost(base_s=0.2, per_byte_s=1e-6)
    profile = linked_profile(slow)
    request = [SimRequest(arrival_s=0.0, prompt_tokens=100, output_tokens=4)]
    in_box = simulate(profile, split(cross_box=False), request)[0]
    across = simulate(profile, split(), request)[0]
    moved = 100 * KV_BYTES
    assert across.ttft == pytest.approx(in_box.ttft)
    extra = slow.seconds(moved) - HANDOFF.seconds(moved)
    assert extra == pytest.approx(0.2 + 0.1 - 0.003 - 0.001)
    assert across.latency - in_box.latency == pytest.approx(extra)
    assert across.itl[0] - in_box.itl[0] == pytest.approx(extra)


def test_handoffs_queue_on_the_one_link_between_the_boxes() -> None:
    # Two prompts prefilled at once by two prefill workers: their KV leaves together,
    # but the link sends one after the other, so the second lands 1 s (its bytes) later.
    link = HandoffCost(base_s=0.0, per_byte_s=1e-5)
    profile = linked_profile(link, atoms=3)
    requests = [SimRequest(0.0, 100, 4), SimRequest(0.0, 100, 4)]
    first, second = sorted(simulate(profile, split(prefill=2), requests), key=lambda r: r.itl[0])
    assert first.ttft == pytest.approx(second.ttft)
    assert second.itl[0] - first.itl[0] == pytest.approx(1.0, abs=0.05)
    in_box = simulate(profile, split(prefill=2, cross_box=False), requests)
    assert in_box[0].itl[0] == pytest.approx(in_box[1].itl[0])  # within a box: no queue


def test_workers_on_different_boxes_do_not_slow_each_other() -> None:
    ends: dict[int, float] = {}
    for boxes, expected in (([0, 1], 1.0), ([0, 0], 2.0)):
        contention = Contention(
            [2.0, 2.0], lambda at, worker, _: ends.__setitem__(worker, at), boxes
        )
        contention.start(0, 0.0, 1.0)
        contention.start(1, 0.0, 1.0)
        assert ends == {0: expected, 1: expected}


def test_a_cross_box_layout_on_a_profile_without_a_link_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"\[1P\]\+\[1D\] spans two boxes .* no network link"):
        simulate(linked_profile(), split(), [SimRequest(0.0, 10, 2)])


def test_the_cross_box_splits_of_an_8_gpu_box_are_every_pair_of_tp_degrees() -> None:
    profile = analytic_profile("a100-80gb-sxm", 8, "opt-13b", link_gbps=400)
    layouts = cross_box_layouts(profile)
    assert len(layouts) == 16  # TP 1, 2, 4, 8 for each pool
    assert all(layout.cross_box and layout.devices == 16 for layout in layouts)
    labels = {layout.label for layout in layouts}
    assert {"[8P]+[8D]", "[1P(tp8)]+[2D(tp4)]", "[4P(tp2)]+[1D(tp8)]"} <= labels


# ------------------------------------------------------------------ the comparison


def interfering_requests(count: int = 120, rate: float = 4.0) -> list[SimRequest]:
    arrivals = sharegpt_like(3, count, rate, 4096)
    return [SimRequest(r.arrival_s, 200, 20) for r in arrivals]


SLO_TPOT = SLO(ttft=2.0, tpot=0.02)


def one_gpu_boxes(network: HandoffCost) -> Profile:
    # A box of one device: alone it can only colocate; two of them can split.
    return linked_profile(network, atoms=1, workers={"1x1": INTERFERING})


def test_a_free_link_and_interfering_prompts_make_the_cross_box_split_win() -> None:
    free = HandoffCost(base_s=0.0, per_byte_s=0.0)
    both = compare_two_boxes(one_gpu_boxes(free), interfering_requests(), 4.0, SLO_TPOT)
    assert both.two_boxes.layout.label == "colocated x1"
    assert both.cross_box.layout.label == "[1P]+[1D]"
    assert both.winner == CROSS_BOX
    assert both.cross_box.attainment > both.two_boxes.attainment + 0.1
    assert both.margin == pytest.approx(both.cross_box.goodput / both.two_boxes.goodput)
    assert both.cross_box.goodput == pytest.approx(4.0 * both.cross_box.attainment)


def test_a_slow_link_makes_two_boxes_win() -> None:
    slow = HandoffCost(base_s=5.0, per_byte_s=0.0)  # 5 s before every second token
    both = compare_two_boxes(one_gpu_boxes(slow), interfering_requests(), 4.0, SLO_TPOT)
    assert both.winner == TWO_BOXES
    assert both.cross_box.met == 0 and math.isinf(both.margin)
    assert "two boxes (the other keeps none)" in table([("test", both)])


def test_the_split_keeps_fewer_requests_as_the_link_slows() -> None:
    requests = interfering_requests(80)
    kept = []
    for base_s in (0.0, 0.01, 0.1, 1.0, 10.0):
        both = compare_two_boxes(
            one_gpu_boxes(HandoffCost(base_s=base_s, per_byte_s=0.0)), requests, 4.0, SLO_TPOT
        )
        kept.append((both.cross_box.met, both.two_boxes.met))
    assert [cross for cross, _ in kept] == sorted((cross for cross, _ in kept), reverse=True)
    assert len({two for _, two in kept}) == 1  # two boxes never cross the link
    assert kept[0][0] > kept[0][1] and kept[-1][0] < kept[-1][1]


def test_boxes_take_arrivals_in_turn_and_a_light_load_is_a_tie() -> None:
    requests = [SimRequest(float(i), 50, 5) for i in range(5)]
    first, second = alternate(requests)
    assert [r.arrival_s for r in first] == [0.0, 2.0, 4.0]
    assert [r.arrival_s for r in second] == [1.0, 3.0]
    profile = linked_profile(network_link(400))
    both = compare_two_boxes(profile, requests, 1.0, SLO(ttft=1.0))
    assert both.winner == TIE and both.margin == 1.0
    assert both.two_boxes.requests == both.cross_box.requests == 5


def test_bad_comparisons_are_clear_errors() -> None:
    requests = [SimRequest(0.0, 50, 5), SimRequest(1.0, 50, 5)]
    with pytest.raises(ValueError, match="network link"):
        compare_two_boxes(linked_profile(), requests, 1.0, SLO(ttft=1.0))
    linked = linked_profile(network_link(400))
    with pytest.raises(ValueError, match="at least two requests"):
        compare_two_boxes(linked, requests[:1], 1.0, SLO(ttft=1.0))
    with pytest.raises(ValueError, match="positive request rate"):
        compare_two_boxes(linked, requests, 0.0, SLO(ttft=1.0))


# ------------------------------------------------------------------ the command

TWO_BOX_ARGS = ["plan", "--workloads", "sharegpt-like", "--num-requests", "30"]


def test_the_command_prints_a_table_of_both_ways_at_each_rate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = linked_profile().save(tmp_path)
    args = [*TWO_BOX_ARGS, "--rates", "1", "2", "--goodput", "ttft:2000", "tpot:200"]
    code = main([*args, "--profile", str(path), "--boxes", "2", "--link-gbps", "400"])
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    assert "50.0 GB/s effective" not in lines[0] and "40.0 GB/s effective" in lines[0]
    header = next(i for i, line in enumerate(lines) if line.startswith("| workload"))
    rows = [line for line in lines[header + 2 :] if line.startswith("|")]
    assert len(rows) == 2
    cells = [c.strip() for c in rows[1].strip("|").split("|")]
    assert cells[0] == "sharegpt-like" and cells[1] == "2"
    assert cells[5].startswith("[")  # the cross-box split, box by box


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--rates", "1", "--boxes", "2"], "--boxes 2 needs the network link"),
        (["--boxes", "2", "--link-gbps", "400"], "needs finite positive --rate or --rates"),
        (["--rates", "1", "--boxes", "2", "--link-gbps", "0"], "finite positive speed"),
        (["--rates", "1", "--boxes", "2", "--link-gbps", "400", "--json"], "markdown table"),
        ([], "the plan needs --rate"),
    ],
)
def test_bad_two_box_input_is_a_clear_error_with_exit_2(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = linked_profile().save(tmp_path)
    assert main([*TWO_BOX_ARGS, "--goodput", "ttft:100", "--profile", str(path), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
