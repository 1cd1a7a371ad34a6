"""The GGUF cache's lock (filelock): two processes that want the same dtype's weights at
once convert them once; the other waits, then maps what the first wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from tests_root import ROOT
from tiny_gguf import read_directly, write_gguf

pytestmark = pytest.mark.process  # the slow lane (conftest.py): processes or a whole model


# Each process loads the file, says it is `ready`, waits for `go` (so both ask at once),
# counts its conversions in `log` (a conversion that takes a while, so the other surely
# finds it under way) and writes the weights it got, as lists, to its output.
WORKER = """
import json, sys, time
from pathlib import Path
import torch
from appliance.model import gguf_dense_cache
from appliance.model.loader import load_model_files

gguf, cache, ready, go, log, out = map(Path, sys.argv[1:])
write_dense = gguf_dense_cache._write_dense

def counted(*args, **kwargs):
    with log.open("a") as file:
        file.write("converting\\n")
    time.sleep(1.0)
    write_dense(*args, **kwargs)

gguf_dense_cache._write_dense = counted
files = load_model_files(gguf, cache)
ready.touch()
while not go.exists():
    time.sleep(0.01)
weights = files.dense_weights(torch.float32)
out.write_text(json.dumps({name: weights[name].tolist() for name in weights}))
"""


def test_two_processes_converting_one_entry_convert_once_and_both_read_it(tmp_path):
    path = write_gguf(tmp_path / "m.gguf")
    cache, go, log = tmp_path / "cache", tmp_path / "go", tmp_path / "conversions"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    readies = [tmp_path / f"ready{i}" for i in range(2)]
    outs = [tmp_path / f"out{i}.json" for i in range(2)]
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, *map(str, (path, cache, ready, go, log, out))],
            env=env,
            cwd=ROOT,
        )
        for ready, out in zip(readies, outs, strict=True)
    ]
    try:
        deadline = time.monotonic() + 120
        while not all(ready.exists() for ready in readies):
            assert time.monotonic() < deadline and all(w.poll() is None for w in workers)
            time.sleep(0.05)
        go.touch()
        for worker in workers:
            assert worker.wait(timeout=120) == 0
    finally:
        for worker in workers:
            worker.kill()
    assert log.read_text().splitlines() == ["converting"]
    expected = read_directly(path)
    for out in outs:
        got = json.loads(out.read_text())
        assert sorted(got) == sorted(expected)
        for name, values in got.items():
            torch.testing.assert_close(torch.tensor(values), expected[name], rtol=0, atol=0)
