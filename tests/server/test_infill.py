"""Code completion at a cursor on a real server (server/infill.py): a random-weight llama
whose vocabulary carries Qwen2.5-Coder's infill markers (no FIM-trained model is on this
machine) answers llama.cpp's /infill, OpenAI's `suffix` and Ollama's `suffix` with
transformers' greedy continuation of <|fim_prefix|>code before<|fim_suffix|>code
after<|fim_middle|>, and stops at the markers' ends; the embedded SmolLM2, which has no
markers, refuses each naming the field."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import ollama
import pytest
from fim_tokenizers import fim_tokenizer
from openai import OpenAI
from random_models import greedy, random_model, save_folder, tiny_llama_config
from server_process import API_KEY, ServerProcess

from appliance.model.model_source import model_name
from appliance.model.tokenizer import Tokenizer

pytestmark = pytest.mark.process  # the slow lane (conftest.py): processes or a whole model

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PREFIX = "def add(a, b):\n    "
SUFFIX = "\n\nprint(add(1, 2))\n"
TOKENS = 8
PRE, SUF, MID, PAD = 11, 12, 13, 14  # the qwen style's ids (fim_tokenizers.py)


@pytest.fixture(scope="module")
def coder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, list[int]]]:
    """The served coder and the token ids transformers continues greedily at the cursor."""
    folder = tmp_path_factory.mktemp("coder") / "tiny-coder"
    reference = random_model(tiny_llama_config(49152, context=512))
    fim_tokenizer(save_folder(reference, folder), "qwen")
    text = Tokenizer.load(folder).encode_text
    prompt = [PRE, *text(PREFIX), SUF, *text(SUFFIX), MID]
    expected = greedy(reference, prompt, TOKENS)
    ends = {PAD, 0, 2, 5}  # <|fim_pad|>, <|endoftext|>, <|im_end|>, <|file_sep|>
    cut = next((i for i, t in enumerate(expected) if t in ends), len(expected))
    assert cut >= TOKENS // 2, "the precondition: a continuation to compare, not an end at once"
    server = ServerProcess(
        {
            "APPLIANCE_MODEL": str(folder),
            "APPLIANCE_DTYPE": "float32",
            "APPLIANCE_API_KEY": API_KEY,
            "APPLIANCE_KV__MEMORY_MB": "32",
        }
    )
    server.start()
    yield server, expected[:cut]
    server.stop()


def test_infill_is_the_models_continuation_between_its_markers(
    coder: tuple[ServerProcess, list[int]],
) -> None:
    server, expected = coder
    http = httpx.Client(base_url=server.url, headers=AUTH, timeout=120)
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": TOKENS}
    reply = http.post("/infill", json=body | {"temperature": 0, "return_tokens": True})
    assert reply.status_code == 200, reply.text
    assert reply.json()["tokens"] == expected
    # llama.cpp's prompt field is text right before the cursor: the same split otherwise
    split = body | {"input_prefix": PREFIX[:4], "prompt": PREFIX[4:]}
    again = http.post("/infill", json=split | {"temperature": 0, "return_tokens": True}).json()
    assert again["content"] == reply.json()["content"]


def test_openai_and_ollama_suffix_give_the_same_infill(
    coder: tuple[ServerProcess, list[int]],
) -> None:
    server, expected = coder
    http = httpx.Client(base_url=server.url, headers=AUTH, timeout=120)
    llama = http.post(
        "/infill",
        json={
            "input_prefix": PREFIX,
            "input_suffix": SUFFIX,
            "n_predict": TOKENS,
            "temperature": 0,
        },
    ).json()
    client = OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    name = model_name(Path(server.env["APPLIANCE_MODEL"]))
    openai = client.completions.create(
        model=name, prompt=PREFIX, suffix=SUFFIX, max_tokens=TOKENS, temperature=0
    )
    assert openai.choices[0].text == llama["content"]
    assert openai.usage is not None and openai.usage.completion_tokens == len(expected)
    editor = ollama.Client(host=server.url, headers=AUTH)
    got = editor.generate(
        model=name, prompt=PREFIX, suffix=SUFFIX, options={"temperature": 0, "num_predict": TOKENS}
    )
    assert got.response == llama["content"]


def test_a_cursor_at_the_start_and_a_long_limit_keep_the_code(
    coder: tuple[ServerProcess, list[int]],
) -> None:
    """An empty prefix is a cursor at the file's start (llama.vscode sends it); a limit
    past the context still leaves the code around the cursor in the prompt."""
    server, _ = coder
    http = httpx.Client(base_url=server.url, headers=AUTH, timeout=120)
    after = len(Tokenizer.load(Path(server.env["APPLIANCE_MODEL"])).encode_text(SUFFIX))
    start = {"input_prefix": "", "input_suffix": SUFFIX, "n_predict": 2, "temperature": 0}
    reply = http.post("/infill", json=start).json()
    assert reply["tokens_evaluated"] == 3 + after  # the markers and the code after
    name = model_name(Path(server.env["APPLIANCE_MODEL"]))
    openai = {"model": name, "prompt": "", "suffix": SUFFIX, "max_tokens": 2}
    assert http.post("/v1/completions", json=openai).status_code == 200
    ollama_body = {"model": name, "prompt": "", "suffix": SUFFIX, "stream": False}
    answered = http.post("/api/generate", json=ollama_body | {"options": {"num_predict": 2}})
    assert answered.json()["done_reason"] != "load"  # an insert, not Ollama's load call
    long = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 4000}
    kept = http.post("/infill", json=long).json()
    assert kept["tokens_evaluated"] == reply["tokens_evaluated"] + len(
        Tokenizer.load(Path(server.env["APPLIANCE_MODEL"])).encode_text(PREFIX)
    )


def test_the_markers_end_stops_the_answer(coder: tuple[ServerProcess, list[int]]) -> None:
    server, _ = coder
    http = httpx.Client(base_url=server.url, headers=AUTH, timeout=120)
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": TOKENS}
    forced = http.post("/infill", json=body | {"logit_bias": [[PAD, 100]]}).json()
    assert (forced["content"], forced["tokens_predicted"], forced["stop_type"]) == ("", 1, "eos")


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/infill", {"input_prefix": PREFIX, "input_suffix": SUFFIX}, "input_suffix"),
        ("/v1/completions", {"prompt": PREFIX, "suffix": SUFFIX}, "suffix"),
    ],
)
def test_a_model_without_markers_refuses_naming_the_field(
    server: ServerProcess, path: str, body: dict[str, str], param: str
) -> None:
    model = {"model": model_name(None), "max_tokens": 4}
    reply = httpx.post(server.url + path, json=body | model, headers=AUTH, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and "does not fill in the middle" in error["message"]
    ollama_reply = httpx.post(
        server.url + "/api/generate",
        json={"model": model_name(None), "prompt": PREFIX, "suffix": SUFFIX, "stream": False},
        headers=AUTH,
        timeout=60,
    )
    assert ollama_reply.status_code == 400
    assert "does not fill in the middle" in ollama_reply.json()["error"]
