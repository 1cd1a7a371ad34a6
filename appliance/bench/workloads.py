"""Benchmark workloads: request prompts of exact token lengths (for our tokenizer) and
output lengths, drawn from a seed so every endpoint gets the very same requests."""

from __future__ import annotations

import ast
import itertools
import json
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from appliance.model.tokenizer import Tokenizer

# Common words; those that are one token with a leading space make prompts whose token
# count is exactly their word count (the tokenizer splits before each space).
WORDS = tuple(
    (
        "the of and to in is was for on that with as by at from his her they this have are "
        "had not but which were she one all been their has when who will more would there "
        "if out so what up about into than its only other new some could time these two may "
        "then first any like now my such make over our even most after also made many did "
        "before must through back years where much your way well down should because each "
        "just those people how too little state good very world still own see men work long "
        "here get both between life being under never day same another know while last might "
        "us great old year off come since against go came right used take three house river "
        "water light night city green small large music story garden stone window paper "
        "market winter summer morning bridge forest island mountain letter ocean village"
    ).split()
)


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload: a raw prompt for /v1/completions and its output length."""

    prompt: str
    prompt_tokens: int
    max_tokens: int


class PromptMaker:
    """Random-word prompts of an exact token count."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.words = [w for w in WORDS if len(tokenizer.encode(" " + w)) == 1]
        if len(self.words) < 20:
            raise ValueError("this tokenizer splits common words; cannot build exact prompts")

    def make(self, num_tokens: int, rng: random.Random) -> str:
        if num_tokens < 1:
            raise ValueError(f"a prompt needs at least one token, got {num_tokens}")
        text = "".join(" " + rng.choice(self.words) for _ in range(num_tokens))
        count = len(self.tokenizer.encode(text))
        if count != num_tokens:  # a tokenizer that merges across spaces
            raise ValueError(f"a {num_tokens}-word prompt came out at {count} tokens")
        return text


def fixed(maker: PromptMaker, rng: random.Random, input_len: int, output_len: int) -> RequestSpec:
    """Every request the same lengths."""
    return RequestSpec(maker.make(input_len, rng), input_len, output_len)


def chat_mix(maker: PromptMaker, rng: random.Random) -> RequestSpec:
    """Chat-like: prompts mostly 50-500 tokens (log-normal), answers 32-256 tokens."""
    prompt = int(min(1024, max(16, rng.lognormvariate(5.0, 0.7))))
    output = rng.randint(32, 256)
    return RequestSpec(maker.make(prompt, rng), prompt, output)


def long_prompt_burst(maker: PromptMaker, rng: random.Random) -> RequestSpec:
    """Mostly short chats, about one in ten with a prompt near 2k tokens: the long ones
    stall every decode that shares their worker (head-of-line blocking)."""
    if rng.random() < 0.1:
        prompt = rng.randint(1800, 2000)
        output = rng.randint(16, 32)
    else:
        prompt = rng.randint(32, 128)
        output = rng.randint(48, 96)
    return RequestSpec(maker.make(prompt, rng), prompt, output)


SHARED_PREFIX_TOKENS = 1024


def shared_prefix(maker: PromptMaker, rng: random.Random) -> Iterator[RequestSpec]:
    """One 1k-token system prompt (drawn once) before every request's own 32-64 token
    question; answers 32-64 tokens. With prefix caching only the question is prefilled."""
    prefix = maker.make(SHARED_PREFIX_TOKENS, rng)
    while True:
        question = rng.randint(32, 64)
        prompt = prefix + maker.make(question, rng)
        yield RequestSpec(prompt, SHARED_PREFIX_TOKENS + question, rng.randint(32, 64))


# The grounded workload: requests whose answers copy their input (summarise, quote or
# edit a passage, return a function with one change), the case speculative decoding's
# prompt lookup is for. The passages are the repository's own text, so every machine
# that has the source has the very same requests.
PROSE_WORDS = (40, 220)  # a documentation paragraph of this many words
CODE_LINES = (6, 40)  # a top-level function of this many lines
GROUNDED_TASKS = ("summarise", "quote", "edit", "code-edit")
SUMMARY_TOKENS = 96  # a summary's answer; the copying tasks answer the passage's length


@dataclass(frozen=True)
class Passage:
    """A piece of the repository's text, verbatim: a prose paragraph or a function."""

    source: str  # the file it came from, relative to the repository root
    text: str
    name: str = ""  # a function's name ("" for prose)


def repository_root() -> Path:
    """The folder that holds the appliance package (the source tree it runs from)."""
    return Path(__file__).resolve().parents[2]


def prose_passages(root: Path) -> list[Passage]:
    """The paragraphs of README.md and docs/*.md that are prose: no headings, lists,
    tables, code or HTML, and a few dozen to a couple of hundred words."""
    pages = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    passages = []
    for page in pages:
        if not page.is_file():
            continue
        text = re.sub(r"^```.*?^```[^\n]*$", "", page.read_text(), flags=re.M | re.S)
        for block in re.split(r"\n\s*\n", text):
            block = block.strip()
            words = len(block.split())
            if not PROSE_WORDS[0] <= words <= PROSE_WORDS[1] or block[0] in "#|-*<>!`[0123456789":
                continue
            passages.append(Passage(page.relative_to(root).as_posix(), block))
    return passages


def code_passages(root: Path) -> list[Passage]:
    """The appliance package's top-level functions of a few to a few dozen lines, as
    written (decorators left out)."""
    passages = []
    for path in sorted((root / "appliance").rglob("*.py")):
        source = path.read_text()
        lines = source.splitlines()
        for node in ast.parse(source).body:
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            end = node.end_lineno or node.lineno
            if CODE_LINES[0] <= end - node.lineno + 1 <= CODE_LINES[1]:
                text = "\n".join(lines[node.lineno - 1 : end])
                passages.append(Passage(path.relative_to(root).as_posix(), text, node.name))
    return passages


def grounded_prompt(task: str, passage: Passage) -> str:
    """The user's message for one grounded task on one passage."""
    if task == "summarise":
        return (
            "Summarise this passage from a project's documentation in two or three "
            f"sentences, keeping its own wording where you can.\n\n{passage.text}"
        )
    if task == "quote":
        return (
            "Quote the passage below back exactly, word for word, then say in one sentence "
            f"what it is about.\n\n{passage.text}"
        )
    if task == "edit":
        return (
            "Proofread the passage below and return the whole passage, with any mistakes "
            f"corrected and everything else unchanged.\n\n{passage.text}"
        )
    if task == "code-edit":
        return (
            "Here is a Python function. Return the whole function again, unchanged except "
            f"that it is renamed from `{passage.name}` to `{passage.name}_v2`."
            f"\n\n```python\n{passage.text}\n```"
        )
    raise ValueError(f"unknown grounded task {task!r}; choose {', '.join(GROUNDED_TASKS)}")


def grounded(
    tokenizer: Tokenizer, rng: random.Random, root: Path | None = None
) -> Iterator[RequestSpec]:
    """Requests to summarise, quote or proofread a paragraph of the documentation, or to
    return a function of the source renamed: one task and one passage drawn per request.
    The prompt is the user's message in the model's chat template (as text: its special
    tokens are matched when it is tokenized); a copying answer may run to the passage's
    length plus a few dozen tokens, a summary to SUMMARY_TOKENS."""
    root = root or repository_root()
    prose, code = prose_passages(root), code_passages(root)
    if not prose or not code:
        raise ValueError(f"{root} has no documentation paragraphs or functions to ground on")
    while True:
        task = rng.choice(GROUNDED_TASKS)
        passage = rng.choice(code if task == "code-edit" else prose)
        message = grounded_prompt(task, passage)
        if tokenizer.chat_template:
            prompt = tokenizer.render_chat([{"role": "user", "content": message}])
        else:
            prompt = message
        length = len(tokenizer.encode(passage.text))
        output = SUMMARY_TOKENS if task == "summarise" else length + 32
        yield RequestSpec(prompt, len(tokenizer.encode(prompt)), output)


WORKLOADS: MappingProxyType[str, Callable[[PromptMaker, random.Random], RequestSpec]] = (
    MappingProxyType({"chat": chat_mix, "long-burst": long_prompt_burst})
)


def generate(
    name: str,
    tokenizer: Tokenizer,
    seed: int,
    input_len: int = 128,
    output_len: int = 64,
    jsonl: Path | None = None,
) -> Iterator[RequestSpec]:
    """An endless stream of requests of workload `name` (fixed, chat, long-burst,
    shared-prefix, grounded, jsonl)."""
    rng = random.Random(seed)
    if name == "jsonl":
        if jsonl is None:
            raise ValueError("the jsonl workload needs --jsonl FILE")
        return _cycle(load_jsonl(jsonl, tokenizer, output_len))
    if name == "grounded":  # the repository's text, not random words
        return grounded(tokenizer, rng)
    maker = PromptMaker(tokenizer)
    if name == "fixed":
        return (fixed(maker, rng, input_len, output_len) for _ in itertools.repeat(None))
    if name == "shared-prefix":
        return shared_prefix(maker, rng)
    if name not in WORKLOADS:
        raise ValueError(
            f"unknown workload {name!r}; choose fixed, chat, long-burst, shared-prefix, "
            "grounded or jsonl"
        )
    pick = WORKLOADS[name]
    return (pick(maker, rng) for _ in itertools.repeat(None))


def load_jsonl(path: Path, tokenizer: Tokenizer, default_output: int) -> list[RequestSpec]:
    """Real prompts, one JSON object per line: {"prompt": str, "max_tokens": int?}."""
    specs = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            prompt, output = item["prompt"], int(item.get("max_tokens", default_output))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}:{number}: need {{'prompt': str}} ({exc})") from None
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"{path}:{number}: prompt must be a non-empty string")
        specs.append(RequestSpec(prompt, len(tokenizer.encode(prompt)), output))
    if not specs:
        raise ValueError(f"{path} holds no prompts")
    return specs


def _cycle(specs: list[RequestSpec]) -> Iterator[RequestSpec]:
    while True:
        yield from specs
