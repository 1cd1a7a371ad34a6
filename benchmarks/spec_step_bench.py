"""What a speculative verify step costs against a plain decode step, part by part.

Loads the default model (what `appliance serve` loads) into an engine, takes one sequence
of `--context` tokens already in the cache, and times in this one process:

step (decode, 1 row)
    model.forward of a decode-only step of one row (the compiled decode step where the
    model takes it), plus the logits of that row.
step (verify, M rows, as a segment)
    the same sequence's verify chunk of M = 1 + k rows attending as a prefill segment
    (the layers' path), plus the logits of its M rows.
step (verify, M rows, as decode rows)
    the M rows as M decode rows of the same sequence, context lengths c + 1 .. c + M
    (what ModelRunner.prepare builds for a verify chunk where the compiled step runs).
products
    each of one layer's quantized projections times M rows, and the logits' product (the
    kernel unpacks each weight group once per tile of rows: 6 on AVX-512, 4 on AVX2; 16
    rows are a 16-stream decode batch's).
sampler
    Sampler.verify of M rows (greedy), and the n-gram proposer over the context.

Times are CPU seconds of this process (time.process_time, one thread), the minimum over
`--repeats` calls after a warm-up: on a loaded box CPU time moves less than wall time,
and the ratios within one run are what the table compares. Prints a markdown table.

Run from the repository root:  OMP_NUM_THREADS=1 .venv/bin/python benchmarks/spec_step_bench.py
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from appliance.engine.llm_engine import LLMEngine
from appliance.engine.sampling.sampler import SampleRow
from appliance.engine.sequence import SamplingParams
from appliance.engine.speculative.ngram import NgramProposer
from appliance.model import cpu_kernels
from appliance.model.layers.paged_attention import AttentionBatch, DecodeGroup, PrefillSegment
from appliance.model.quant import QuantLinear, projections
from appliance.settings.config import load_settings
from appliance.topology.cpu import cpu_model_name


def cpu_seconds(fn: Callable[[], object], repeats: int) -> float:
    """The least CPU time of `repeats` calls of fn, after one uncounted call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best


class Steps:
    """One sequence of `context` tokens in the engine's cache and the steps over it."""

    def __init__(self, engine: LLMEngine, context: int, max_rows: int) -> None:
        self.engine = engine
        self.model = engine.model
        bs = engine.kv.block_size
        blocks = -(-(context + max_rows) // bs)
        self.table = list(range(1, blocks + 1))  # block 0 left alone
        self.context = context
        self.block_size = bs
        ids = torch.randint(100, 20000, (context,))
        prefill = AttentionBatch(
            self._slots(0, context), [PrefillSegment(0, context, context, self._table())], 0, []
        )
        self.model(ids, torch.arange(context), prefill, engine.kv.tensor)

    def _table(self) -> torch.Tensor:
        return torch.tensor(self.table, dtype=torch.int64)

    def _slots(self, start: int, rows: int) -> torch.Tensor:
        bs = self.block_size
        return torch.tensor(
            [self.table[p // bs] * bs + p % bs for p in range(start, start + rows)],
            dtype=torch.int64,
        )

    def decode_rows(self, rows: int) -> AttentionBatch:
        """`rows` decode rows of this one sequence, contexts c + 1 .. c + rows."""
        c, bs = self.context, self.block_size
        tables = self._table()[None, :].expand(rows, -1).contiguous()
        lens = torch.arange(c + 1, c + 1 + rows, dtype=torch.int64)
        keys = torch.arange(len(self.table) * bs)
        visible = (keys[None, :] < lens[:, None])[:, None, None, :]
        group = DecodeGroup(None, tables, visible, lens)
        return AttentionBatch(self._slots(c, rows), [], 0, [group])

    def segment(self, rows: int) -> AttentionBatch:
        """The `rows` rows as one verify chunk attending as a segment (today's verify)."""
        c = self.context
        seg = PrefillSegment(0, rows, c + rows, self._table())
        return AttentionBatch(self._slots(c, rows), [seg], rows, [], prompt_rows=0)

    def run(self, batch: AttentionBatch, rows: int) -> Callable[[], object]:
        ids = torch.randint(100, 20000, (rows,))
        positions = torch.arange(self.context, self.context + rows)
        model, kv = self.model, self.engine.kv.tensor

        def step() -> object:
            hidden = model(ids, positions, batch, kv)
            return model.logits(hidden).argmax(-1).tolist()

        return step

    def forward_only(self, batch: AttentionBatch, rows: int) -> Callable[[], object]:
        ids = torch.randint(100, 20000, (rows,))
        positions = torch.arange(self.context, self.context + rows)
        return lambda: self.model(ids, positions, batch, self.engine.kv.tensor)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 5, 8, 9, 16])
    args = parser.parse_args()
    torch.set_num_threads(1)
    engine = LLMEngine.from_settings(load_settings())
    steps = Steps(engine, args.context, max(args.rows))
    model = engine.model
    compiled = model.decode_step is not None
    level = cpu_kernels.level()
    print(
        f"CPU: {cpu_model_name()}, 1 thread, context {args.context}, compiled step {compiled},"
        f" kernels {level}"
    )
    one = cpu_seconds(steps.run(steps.decode_rows(1), 1), args.repeats)
    print(f"plain decode step (1 row, forward + logits): {one * 1e3:.2f} ms CPU\n")
    print("| rows | verify as segment | as decode rows | forward: segment | decode rows |")
    print("|---:|---:|---:|---:|---:|")
    for m in args.rows:
        seg = cpu_seconds(steps.run(steps.segment(m), m), args.repeats)
        dec = cpu_seconds(steps.run(steps.decode_rows(m), m), args.repeats)
        fseg = cpu_seconds(steps.forward_only(steps.segment(m), m), args.repeats)
        fdec = cpu_seconds(steps.forward_only(steps.decode_rows(m), m), args.repeats)
        print(
            f"| {m} | {seg * 1e3:.2f} ms ({seg / one:.2f}x) | {dec * 1e3:.2f} ms ({dec / one:.2f}x)"
            f" | {fseg * 1e3:.2f} ms | {fdec * 1e3:.2f} ms |"
        )
    layer = model.layers[0]
    print("\nproducts (ms CPU, all layers' copies of each projection):")
    print("| rows | " + " | ".join(projections(layer)) + " | logits |")
    print("|---:|" + "---:|" * (len(projections(layer)) + 1))
    hidden = model.config.hidden_size
    for m in args.rows:
        cells = []
        for linear in projections(layer).values():
            assert isinstance(linear, QuantLinear)
            x = torch.randn(m, linear.in_features)
            t = cpu_seconds(lambda lin=linear, x=x: lin(x), args.repeats)
            cells.append(f"{t * 1e3 * len(model.layers):.2f}")
        h = torch.randn(m, hidden)
        t = cpu_seconds(lambda h=h: model.logits(h), args.repeats)
        print(f"| {m} | " + " | ".join(cells) + f" | {t * 1e3:.2f} |")
    sampler = engine.runner.sampler
    params = SamplingParams(max_tokens=100, temperature=0)
    tokens = torch.randint(100, 20000, (args.context,)).tolist()
    proposer = NgramProposer(2, 5)
    print("\nhost parts (ms CPU):")
    for m in args.rows:
        logits = torch.randn(m, model.config.vocab_size)
        row = SampleRow(0, params, tokens)
        drafts = list(range(1, m))
        t = cpu_seconds(lambda lg=logits, d=drafts, r=row: sampler.verify(lg, r, d), args.repeats)
        print(f"sampler.verify, {m} rows: {t * 1e3:.3f}")
    t = cpu_seconds(lambda: proposer.propose(tokens, 4), args.repeats)
    print(f"ngram propose over {args.context} tokens: {t * 1e3:.3f}")


if __name__ == "__main__":
    main()
