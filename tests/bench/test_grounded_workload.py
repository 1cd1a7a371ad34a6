"""The grounded workload: the same requests for the same seed, each built on a passage of
the repository's own documentation or source, its answer budget the passage's length.
Only the tokenizer is loaded (no model, no processes), but for the last test, which sends
the workload with `appliance bench` to the suite's server."""

from __future__ import annotations

import functools
import itertools
import json
import random
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_process import API_KEY, ServerProcess

from appliance.bench import workloads
from appliance.bench.workloads import (
    GROUNDED_TASKS,
    Passage,
    RequestSpec,
    generate,
    grounded,
    grounded_prompt,
)
from appliance.model.model_source import prepare_tokenizer
from appliance.model.tokenizer import Tokenizer
from appliance.settings.config import load_settings

ROOT = Path(__file__).resolve().parents[2]
TASK_OPENINGS = {
    "summarise": "Summarise this passage",
    "quote": "Quote the passage below",
    "edit": "Proofread the passage below",
    "code-edit": "Here is a Python function",
}


@pytest.fixture(scope="module", autouse=True)
def passages_read_once() -> Iterator[None]:
    """The workload reads the repository's passages (every module of appliance/ parsed)
    each time it starts; these tests start it six times on the repository, so each
    root's passages are read once here. What they are is unchanged: the workload's own
    readers, remembered by root."""
    with pytest.MonkeyPatch.context() as patch:
        for reader in (workloads.prose_passages, workloads.code_passages):
            patch.setattr(workloads, reader.__name__, functools.cache(reader))
        yield


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    settings = load_settings()
    return prepare_tokenizer(settings.model, settings.cache_dir)[1]


def repository_texts() -> list[str]:
    """Every file the workload may quote, read here on its own."""
    files = [ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("appliance/**/*.py")]
    return [f.read_text() for f in files]


def passage_of(spec: RequestSpec) -> str:
    """The passage a prompt carries: the user's message after its instruction line, out
    of its code fence, up to the end of the message."""
    message = spec.prompt.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
    passage = message.split("\n\n", 1)[1]
    fenced = re.fullmatch(r"```python\n(.*)\n```", passage, re.S)
    return fenced.group(1) if fenced else passage


def test_the_same_seed_gives_the_same_requests(tokenizer: Tokenizer) -> None:
    first = list(itertools.islice(generate("grounded", tokenizer, seed=5), 40))
    again = list(itertools.islice(generate("grounded", tokenizer, seed=5), 40))
    other = list(itertools.islice(generate("grounded", tokenizer, seed=6), 40))
    assert first == again
    assert first != other
    assert len({s.prompt for s in first}) >= 30  # drawn from many passages, not a few


def test_every_prompt_carries_a_passage_of_the_repository(tokenizer: Tokenizer) -> None:
    texts = repository_texts()
    specs = list(itertools.islice(generate("grounded", tokenizer, seed=1), 40))
    for spec in specs:
        passage = passage_of(spec)
        assert len(passage.split()) >= 10, spec.prompt
        assert any(passage in text for text in texts), passage[:200]
        assert spec.prompt.endswith("<|im_start|>assistant\n")  # the model's chat template
        assert len(tokenizer.encode(spec.prompt)) == spec.prompt_tokens
    openings = {
        task for task, opening in TASK_OPENINGS.items() for s in specs if opening in s.prompt
    }
    assert openings == set(GROUNDED_TASKS)  # 40 draws of 4 tasks: each one comes up


def test_copying_answers_get_the_passage_length(tokenizer: Tokenizer) -> None:
    """A copying task may answer the whole passage (and a few dozen tokens more), a
    summary a fixed budget; so the answers lookup decoding can copy are not cut short."""
    specs = list(itertools.islice(generate("grounded", tokenizer, seed=2), 40))
    for spec in specs:
        length = len(tokenizer.encode(passage_of(spec)))
        if "Summarise this passage" in spec.prompt:
            assert spec.max_tokens == 96
        else:
            assert spec.max_tokens == length + 32


def test_the_code_edit_names_the_function_it_renames() -> None:
    passage = Passage(
        "appliance/x.py", "def area(w: int, h: int) -> int:\n    return w * h", "area"
    )
    prompt = grounded_prompt("code-edit", passage)
    assert "renamed from `area` to `area_v2`" in prompt
    assert prompt.endswith("```python\ndef area(w: int, h: int) -> int:\n    return w * h\n```")
    with pytest.raises(ValueError, match="unknown grounded task 'translate'"):
        grounded_prompt("translate", passage)


def test_a_tree_without_docs_or_functions_is_refused(tokenizer: Tokenizer, tmp_path: Path) -> None:
    (tmp_path / "README.md").write_text("# Nothing\n\nToo short.\n")
    with pytest.raises(ValueError, match="no documentation paragraphs or functions"):
        next(grounded(tokenizer, random.Random(0), tmp_path))


def test_appliance_bench_sends_the_grounded_workload(
    server: ServerProcess, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    """`appliance bench --workload grounded` drives this workload: the seed's requests in
    order (their prompt lengths), each answered (cut to 4 tokens by --extra-body)."""
    args = ["--url", server.url, "--api-key", API_KEY, "--workload", "grounded"]
    args += ["--num-requests", "3", "--warmup", "0", "--concurrency", "1", "--seed", "4"]
    args += ["--extra-body", '{"max_tokens": 4, "ignore_eos": true}', "--out", str(tmp_path)]
    bench = [sys.executable, "-m", "appliance.cli", "bench", *args]
    result = subprocess.run(bench, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    saved = json.loads((tmp_path / "result.json").read_text())
    sent = [r["prompt_tokens"] for r in saved["results"]]
    specs = itertools.islice(generate("grounded", tokenizer, seed=4), 3)
    assert sent == [s.prompt_tokens for s in specs]
    assert all(r["output_tokens"] == 4 for r in saved["results"])
