"""The admin API's pure parts on plain data: the latency window, tuning validation, the
token file, who the admin API lets in, CPU devices that share cores, and the planner's
decisions with the rule and inputs that decided them."""

from __future__ import annotations

import stat
from pathlib import Path
from types import SimpleNamespace

import pytest
from pydantic import ValidationError
from starlette.requests import Request

from appliance.admin.device_stats import DeviceStats
from appliance.admin.latency_window import Finished, LatencyWindow
from appliance.admin.schema import MoveRequest, Tuning, TuningPatch
from appliance.admin.token import TokenError, read_token, remove_token, write_token
from appliance.core.tuning import batch_limits
from appliance.server.admin import AdminState
from appliance.server.errors import APIError
from appliance.settings.config import load_settings
from appliance.topology.cpu import cpu_devices
from appliance.topology.devices import Device

# ---------------------------------------------------------------- latency window


def test_window_percentiles_and_rates_over_what_finished_lately() -> None:
    window = LatencyWindow(window_s=10)
    window.record(Finished(at=1.0, ttft=9.0, tpot=0.9, output_tokens=100))  # falls out
    for i, ttft in enumerate([0.1, 0.2, 0.3, 0.4]):
        window.record(Finished(at=5.0 + i, ttft=ttft, tpot=0.01 * (i + 1), output_tokens=10))
    window.record(Finished(at=9.5, ttft=0.5, tpot=None, output_tokens=1))
    latency = window.summary(now=12.0)
    assert latency.finished == 5
    assert latency.ttft_ms.p50 == pytest.approx(300)
    assert latency.ttft_ms.p99 == pytest.approx(100 * (4 + 0.96))  # between 400 and 500
    assert latency.tpot_ms.p50 == pytest.approx(25)  # the one-token request has no TPOT
    assert latency.requests_per_s == pytest.approx(0.5)
    assert latency.output_tokens_per_s == pytest.approx(4.1)


def test_an_empty_window_has_no_percentiles() -> None:
    latency = LatencyWindow(window_s=60).summary(now=100.0)
    assert latency.finished == 0 and latency.ttft_ms.p50 is None and latency.tpot_ms.p99 is None
    with pytest.raises(ValueError, match="window_s"):
        LatencyWindow(window_s=0)


# ---------------------------------------------------------------- tuning


def tuning() -> Tuning:
    return Tuning(
        prefill_token_budget=2048,
        chunk_size=512,
        decode_max_seqs=64,
        routing="least_loaded",
        admission="open",
    )


def test_a_patch_changes_only_its_fields() -> None:
    changed = TuningPatch(decode_max_seqs=8, routing="round_robin").applied_to(tuning())
    assert changed.decode_max_seqs == 8 and changed.routing == "round_robin"
    assert changed.prefill_token_budget == 2048 and changed.admission == "open"


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"chunk_size": 4096}, "chunk_size (4096) must not exceed prefill_token_budget"),
        ({"prefill_token_budget": 256}, "chunk_size (512) must not exceed"),
    ],
)
def test_a_patch_that_breaks_the_whole_is_refused(patch: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        TuningPatch(**patch).applied_to(tuning())


@pytest.mark.parametrize(
    "body",
    [
        {"decode_max_seqs": 0},
        {"chunk_size": 8},
        {"routing": "random"},
        {"admission": "closed"},
        {"max_num_seqs": 4},  # not a knob of the API
        {"decode_max_seqs": "many"},
    ],
)
def test_bad_knobs_are_refused(body: dict) -> None:
    with pytest.raises(ValidationError):
        TuningPatch.model_validate(body)


def test_move_requests_validate() -> None:
    assert MoveRequest.model_validate({"device": 2, "to": "prefill"}).device == 2
    assert MoveRequest.model_validate({"device": 1, "to": "colocated"}).to == "colocated"
    for body in ({"device": -1, "to": "decode"}, {"device": 1, "to": "both"}, {"to": "x"}):
        with pytest.raises(ValidationError):
            MoveRequest.model_validate(body)


# ---------------------------------------------------------------- token and access


def test_the_token_file_is_readable_by_its_user_only(tmp_path: Path) -> None:
    path = tmp_path / "admin" / "8000.token"
    path.parent.mkdir(mode=0o755)
    path.write_text("old")
    path.chmod(0o644)  # a file left by an older server, too open
    token = write_token(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_token(path) == token and len(token) >= 32
    assert write_token(path) != token  # each start makes a new one


def test_reading_a_missing_or_empty_token_says_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(TokenError, match="is the appliance running"):
        read_token(tmp_path / "none.token")
    (tmp_path / "empty.token").write_text("")
    with pytest.raises(TokenError, match="is empty"):
        read_token(tmp_path / "empty.token")


def test_removing_keeps_a_token_another_server_wrote(tmp_path: Path) -> None:
    path = tmp_path / "t"
    mine = write_token(path)
    theirs = write_token(path)
    remove_token(path, mine)
    assert path.read_text() == theirs
    remove_token(path, theirs)
    assert not path.exists()


def request_from(host: str, authorization: str | None, server: str = "127.0.0.1") -> Request:
    headers = [(b"authorization", authorization.encode())] if authorization else []
    scope = {"type": "http", "method": "GET", "path": "/admin/state", "headers": headers}
    return Request({**scope, "client": (host, 50000), "server": (server, 8000)})


@pytest.mark.parametrize(
    ("host", "authorization", "status"),
    [
        ("127.0.0.1", "Bearer secret", None),
        ("::1", "Bearer secret", None),
        ("127.0.0.1", None, 401),
        ("127.0.0.1", "Bearer wrong", 401),
        ("127.0.0.1", "secret", 401),
        ("192.168.1.20", "Bearer secret", 403),  # the right token from another machine
    ],
)
def test_admin_access(host: str, authorization: str | None, status: int | None) -> None:
    admin = AdminState(appliance=None, snapshots=None, token_path=Path("t"), token="secret")
    if status is None:
        admin.authorize(request_from(host, authorization))
        return
    with pytest.raises(APIError) as caught:
        admin.authorize(request_from(host, authorization))
    assert caught.value.status == status


def test_a_client_at_the_servers_own_lan_address_is_local() -> None:
    admin = AdminState(appliance=None, snapshots=None, token_path=Path("t"), token="secret")
    admin.authorize(request_from("192.168.1.20", "Bearer secret", server="192.168.1.20"))
    with pytest.raises(APIError) as caught:
        admin.authorize(request_from("192.168.1.21", "Bearer secret", server="192.168.1.20"))
    assert caught.value.status == 403


def test_a_symlink_at_the_token_path_is_replaced_not_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    link = tmp_path / "admin.token"
    link.symlink_to(victim)
    token = write_token(link)
    assert victim.read_text() == "keep me"
    assert not link.is_symlink() and link.read_text() == token


def test_nobody_gets_in_before_the_token_is_written() -> None:
    admin = AdminState(appliance=None, snapshots=None, token_path=Path("t"), token=None)
    with pytest.raises(APIError) as caught:
        admin.authorize(request_from("127.0.0.1", "Bearer None"))
    assert caught.value.status == 401


def test_the_token_path_defaults_per_port(tmp_path: Path) -> None:
    settings = load_settings(cache_dir=tmp_path, port=8123)
    assert settings.admin_token_path() == tmp_path / "admin" / "8123.token"
    chosen = load_settings(admin={"token_file": tmp_path / "x"})
    assert chosen.admin_token_path() == tmp_path / "x"


# ---------------------------------------------------------------- shared cores


def test_more_devices_than_cores_share_them_when_allowed() -> None:
    devices = cpu_devices(3, cores=[0, 1], share_cores=True)
    assert [d.cores for d in devices] == [(0,), (1,), (0,)]
    assert devices[2].name == "cpu2 (core 0, shared)"
    with pytest.raises(ValueError, match="unless cpu_share_cores is set"):
        cpu_devices(3, cores=[0, 1])


# ---------------------------------------------------------------- tuning on the supervisor


def test_colocated_tuning_keeps_a_token_of_budget_per_sequence() -> None:
    from appliance.pools.supervisor import Supervisor

    colocated = Supervisor(load_settings(device="cpu", cpu_devices=1, mode="colocated"))
    with pytest.raises(ValueError, match=r"decode_max_seqs \(4096\) must not exceed"):
        colocated.tune(TuningPatch(decode_max_seqs=4096))
    assert colocated.tune(TuningPatch(decode_max_seqs=32)).decode_max_seqs == 32


def test_decode_workers_get_budget_for_every_sequence() -> None:
    from appliance.pools.supervisor import Supervisor

    supervisor = Supervisor(load_settings(device="cpu", cpu_devices=2))
    tuning = supervisor.tune(
        TuningPatch(decode_max_seqs=4096, prefill_token_budget=256, chunk_size=128)
    )
    assert supervisor.events[-1].kind == "tuning"
    decode = batch_limits(supervisor.settings.batch, "decode", tuning)
    assert decode == {"max_num_seqs": 4096, "max_num_batched_tokens": 4096}
    prefill = batch_limits(supervisor.settings.batch, "prefill", tuning)
    assert prefill == {"max_num_batched_tokens": 256, "chunk_size": 128}


def test_prompts_go_where_their_prefix_was_prefilled_unless_its_queue_outweighs_it() -> None:
    from appliance.admin.schema import Tuning
    from appliance.core.router import Router
    from appliance.pools.worker_handle import WorkerHandle

    budget = 512
    tuning = Tuning(
        prefill_token_budget=budget,
        chunk_size=256,
        decode_max_seqs=64,
        routing="least_loaded",
        admission="open",
    )
    router = Router(block_size=16, prefix_caching=True)
    busy, idle = (WorkerHandle(i, "prefill", i, f"cpu{i}", (i,), None, None) for i in (0, 1))
    system = list(range(100, 164))  # four 16-token blocks
    busy.queued_tokens = 0
    assert router.prefill([busy, idle], [*system, 1, 2, 3], tuning) is busy  # ties: first
    busy.queued_tokens = 1000
    idle.queued_tokens = 1000 - 60  # busy saves 64 tokens, 60 more queued: busy
    assert router.prefill([busy, idle], [*system, 7, 8, 9], tuning) is busy
    busy.queued_tokens = idle.queued_tokens + 65  # its queue outweighs what it saves
    assert router.prefill([busy, idle], [*system, 4, 5, 6], tuning) is idle
    busy.queued_tokens, busy.running = idle.queued_tokens, 1
    assert router.prefill([busy, idle], list(range(64)), tuning) is idle  # no prefix: fewer run
    caching_off = Router(block_size=16, prefix_caching=False)
    idle.queued_tokens = busy.queued_tokens - 1
    assert caching_off.prefill([busy, idle], [*system, 1, 2, 3], tuning) is idle
    in_turn = tuning.model_copy(update={"routing": "round_robin"})
    picks = [router.prefill([busy, idle], [1, 2], in_turn) for _ in range(4)]
    assert picks == [busy, idle, busy, idle]


def test_handoffs_go_to_the_decode_worker_with_most_room() -> None:
    from appliance.core.router import Router
    from appliance.pools.worker_handle import WorkerHandle

    a, b, c = (WorkerHandle(i, "decode", i, f"cpu{i}", (i,), None, None) for i in range(3))
    a.num_free, b.num_free, c.num_free = 10, 40, 40
    b.running, c.running = 5, 2
    source = WorkerHandle(3, "prefill", 3, "cpu3", (3,), None, None)
    router = Router(16, True)
    assert router.decode([a, b, c], {}, source, 1) is c
    # c has been sent handoffs it has not answered: its report does not hold them yet
    assert router.decode([a, b, c], {c.worker_id: 3}, source, 1) is b
    assert router.decode([a, b, c], {b.worker_id: 31, c.worker_id: 31}, source, 1) is a


class _RecordedNvml:
    """NVML as data: each GPU's utilization by NVML index, and the indices asked for."""

    class NVMLError(Exception):
        pass

    def __init__(self, busy: dict[int, int]) -> None:
        self.busy = busy
        self.asked: list[int] = []

    def nvmlInit(self) -> None:
        pass

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        self.asked.append(index)
        return index

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(gpu=self.busy[handle])

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(used=handle * 2**30, total=80 * 2**30)


def test_gpu_stats_are_read_from_nvmls_gpu_not_the_devices_position() -> None:
    # CUDA_VISIBLE_DEVICES=4,5: device 0 (cuda:0) is NVML's GPU 4
    nvml = _RecordedNvml({4: 91, 5: 7})
    gpu = Device("cuda", 0, "H100", 80 * 2**30, 80 * 2**30, ordinal=0, nvml_index=4)
    load = DeviceStats(nvml).sample(gpu, None, 0.0)
    assert nvml.asked == [4]
    assert (load.utilization, load.memory_used) == (91.0, 4 * 2**30)


# ---------------------------------------------------------------- planner decisions


def test_a_decision_carries_the_verdicts_rule_and_inputs() -> None:
    from appliance.admin.schema import Decision, Measured
    from appliance.ops.autopilot import _decision
    from appliance.planner.rebalance import Measurement, TrafficMix, TrafficWindow, Verdict

    split, colocated = ("prefill", "decode"), ("colocated", "colocated")
    now_mix, old_mix = TrafficMix(2.0, 500.0, 60.0), TrafficMix(1.8, 450.0, 64.0)
    verdict = Verdict(
        current=split,
        recommended=split,
        move=None,
        predicted_current=0.0,
        predicted_recommended=0.0,
        reason="every layout simulated at ~0; the current one measured best",
        rule="measured-stay",
        simulated={split: 0.0, colocated: 0.05, ("prefill", None): 0.0},
        measured=Measurement(at=100.0, attainment=0.8, goodput=1.6, mix=now_mix),
        remembered={colocated: Measurement(at=40.0, attainment=0.5, goodput=0.9, mix=old_mix)},
        barred={colocated: "measured worse on similar traffic (50% < 80%)"},
    )
    window = TrafficWindow(20.0, (), attainment=0.8)
    decision = _decision(verdict, window, acted=False, reason=verdict.reason, now=100.0)

    assert decision.rule == "measured-stay"
    assert decision.reason == verdict.reason
    assert decision.simulated == {
        "prefill,decode": 0.0,
        "colocated,colocated": 0.05,
        "prefill,-": 0.0,
    }
    assert decision.measured == Measured(
        age_s=0.0,
        attainment=0.8,
        goodput=1.6,
        rate=2.0,
        mean_prompt_tokens=500.0,
        mean_output_tokens=60.0,
    )
    remembered = decision.remembered["colocated,colocated"]
    assert (remembered.age_s, remembered.attainment, remembered.goodput) == (60.0, 0.5, 0.9)
    assert (remembered.rate, remembered.mean_prompt_tokens, remembered.mean_output_tokens) == (
        1.8,
        450.0,
        64.0,
    )
    assert decision.barred == {
        "colocated,colocated": "measured worse on similar traffic (50% < 80%)"
    }
    # What the admin API sends comes back whole to the console.
    assert Decision.model_validate_json(decision.model_dump_json()) == decision

    # A verdict with none of them, and a decision from an older appliance that sends none.
    bare = _decision(
        Verdict(split, split, None, 1.0, 1.0, "held"), window, acted=False, reason="held", now=5.0
    )
    assert (bare.rule, bare.simulated, bare.measured, bare.remembered, bare.barred) == (
        "",
        {},
        None,
        {},
        {},
    )
    old = bare.model_dump(exclude={"rule", "simulated", "measured", "remembered", "barred"})
    assert Decision.model_validate(old) == bare
