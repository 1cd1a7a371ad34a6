"""batch.cuda_graphs: the setting, the batch sizes it captures, and what a worker does
with it where there is no CUDA (this machine). The capture itself runs on a GPU only:
benchmarks/gpu_tests/test_cuda_steps.py."""

from __future__ import annotations

import logging

import pytest

from appliance.engine.llm_engine import LLMEngine
from appliance.engine.model_runner import ModelRunner, decode_graph_sizes
from appliance.settings import engine as engine_settings
from appliance.settings.config import BatchSettings, KVSettings, SettingsError, load_settings

pytestmark = pytest.mark.process  # the slow lane (conftest.py): processes or a whole model


def test_off_by_default_and_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_settings().batch.cuda_graphs is False
    monkeypatch.setenv("APPLIANCE_BATCH__CUDA_GRAPHS", "true")
    assert load_settings(device="cuda").batch.cuda_graphs is True


def test_the_sections_moved_out_keep_their_import_path() -> None:
    assert BatchSettings is engine_settings.BatchSettings
    assert KVSettings is engine_settings.KVSettings
    assert "cuda_graphs" in BatchSettings.model_fields


@pytest.mark.parametrize(
    ("overrides", "why"),
    [
        ({"device": "cpu"}, "device is cpu"),
        ({"decode_tp": 2}, "decoding workers span 2 devices"),
        ({"mode": "colocated", "prefill_tp": 2}, "decoding workers span 2 devices"),
    ],
)
def test_refused_where_it_cannot_apply(overrides: dict[str, object], why: str) -> None:
    with pytest.raises(SettingsError, match=f"batch.cuda_graphs needs .*{why}"):
        load_settings(batch={"cuda_graphs": True}, **overrides)


def test_allowed_where_only_prefill_workers_are_split() -> None:
    settings = load_settings(batch={"cuda_graphs": True}, prefill_tp=2, decode_tp=1)
    assert settings.batch.cuda_graphs


@pytest.mark.parametrize(
    ("max_num_seqs", "sizes"),
    [
        (1, (1,)),
        (2, (1, 2)),
        (3, (1, 2, 3)),
        (48, (1, 2, 4, 8, 16, 32, 48)),
        (64, (1, 2, 4, 8, 16, 32, 64)),
    ],
)
def test_graph_sizes_are_powers_of_two_up_to_max_num_seqs(
    max_num_seqs: int, sizes: tuple[int, ...]
) -> None:
    assert decode_graph_sizes(max_num_seqs) == sizes


def test_graph_sizes_need_a_batch() -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        decode_graph_sizes(0)


def test_a_cpu_runner_logs_that_graphs_are_cuda_only(
    engine: LLMEngine, caplog: pytest.LogCaptureFixture
) -> None:
    runner = ModelRunner(engine.model, engine.kv, engine.runner.sampler)
    with caplog.at_level(logging.WARNING, logger="appliance.engine"):
        assert runner.use_decode_graphs(64, 512) is False
    assert runner.decode_graphs is None
    assert "CUDA graphs apply to CUDA devices only" in caplog.text
    assert "cpu" in caplog.text


def test_a_worker_on_the_cpu_with_auto_device_runs_eagerly(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    asked: list[tuple[int, int]] = []
    real = ModelRunner.use_decode_graphs

    def recording(runner: ModelRunner, max_num_seqs: int, max_len: int) -> bool:
        asked.append((max_num_seqs, max_len))
        return real(runner, max_num_seqs, max_len)

    monkeypatch.setattr(ModelRunner, "use_decode_graphs", recording)
    settings = load_settings(
        dtype="float32", weights="dense", batch={"cuda_graphs": True, "max_num_seqs": 8}
    )
    assert settings.device == "auto"  # resolved to the CPU here, as a worker's would be
    with caplog.at_level(logging.WARNING, logger="appliance.engine"):
        decoder = LLMEngine.from_settings(settings)
        prefiller = LLMEngine.from_settings(settings, shared_kv=True, decodes=False)
    assert asked == [(8, decoder.scheduler.limits.max_model_len)]  # the prefill one never
    assert decoder.runner.decode_graphs is None and prefiller.runner.decode_graphs is None
    assert caplog.text.count("CUDA graphs apply to CUDA devices only") == 1
