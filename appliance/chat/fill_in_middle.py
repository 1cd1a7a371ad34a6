"""Fill in the middle: code completion at a cursor, for the editors' plugins that ask for
it (llama.cpp's /infill, Ollama's `suffix`, OpenAI's legacy `suffix`). A code model trained
for it reads the code before the cursor and after it between its own marker tokens and
writes what goes between; each family spells the markers its own way, found here in the
vocabulary by their text (as llama.cpp finds them):

    Qwen2.5/3-Coder, CodeGemma   <|fim_prefix|>prefix<|fim_suffix|>suffix<|fim_middle|>
    StarCoder, StarCoder2        <fim_prefix>prefix<fim_suffix>suffix<fim_middle>
    CodeLlama                    ▁<PRE>prefix▁<SUF>suffix▁<MID>
    DeepSeek-Coder               <｜fim▁begin｜>prefix<｜fim▁hole｜>suffix<｜fim▁end｜>
    Codestral                    [SUFFIX]suffix[PREFIX]prefix   (suffix first)

Other files of the project (llama.cpp's `input_extra`) go before, in the repository-level
form where the model has its markers (`<|repo_name|>`, `<|file_sep|>`: Qwen's) and as
plain snippets otherwise. The markers are token ids, never text in the prompt, so code
that holds a marker's spelling cannot forge one. Pure Python: no torch."""

from __future__ import annotations

from dataclasses import dataclass

from appliance.model.tokenizer import Tokenizer

# (prefix, suffix, middle) spellings, and whether the suffix comes first.
MARKERS: tuple[tuple[str, str, str, bool], ...] = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", False),
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>", False),
    ("▁<PRE>", "▁<SUF>", "▁<MID>", False),
    ("<PRE>", "<SUF>", "<MID>", False),
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>", False),
    ("[PREFIX]", "[SUFFIX]", "[MIDDLE]", True),
)
REPO_MARKERS = ("<|repo_name|>", "<repo_name>")
FILE_MARKERS = ("<|file_sep|>", "<file_sep>", "<|file_separator|>")
# Tokens that end an infill besides the model's own end: padding, the next file, EOT.
END_MARKERS = ("<|fim_pad|>", "<fim_pad>", "▁<EOT>", "<EOT>", "<|endoftext|>", *FILE_MARKERS)
SNIPPET = "\n\n--- snippet ---\n\n"  # between extra files, without a file marker
PREFIX_SHARE = 0.75  # of the room for code when it must be cut: the rest is the suffix's


@dataclass(frozen=True)
class ExtraFile:
    """Another file of the project, for context (llama.cpp's input_extra chunk)."""

    filename: str
    text: str


@dataclass(frozen=True)
class FillInMiddle:
    """A model's markers, as token ids."""

    prefix: int
    suffix: int
    middle: int
    suffix_first: bool
    repo: int | None
    file_sep: int | None
    ends: frozenset[int]

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> FillInMiddle | None:
        """The model's markers, or None where its vocabulary has none (it was not trained
        to fill in the middle: SmolLM2, most chat models)."""
        for pre, suf, mid, suffix_first in MARKERS:
            ids = [tokenizer.token_id(t) for t in (pre, suf, mid)]
            if None in ids:
                continue
            repo = _first_id(tokenizer, REPO_MARKERS)
            file_sep = _first_id(tokenizer, FILE_MARKERS)
            ends = {i for t in END_MARKERS if (i := tokenizer.token_id(t)) is not None}
            prefix, suffix, middle = (i for i in ids if i is not None)
            return cls(prefix, suffix, middle, suffix_first, repo, file_sep, frozenset(ends))
        return None

    def prompt(
        self,
        tokenizer: Tokenizer,
        prefix: str,
        suffix: str,
        extra: tuple[ExtraFile, ...] = (),
        budget: int | None = None,
    ) -> list[int]:
        """The ids of an infill of the cursor between `prefix` and `suffix`, the `extra`
        files before; within `budget` tokens where given: extra files go first (the
        oldest), then the prefix keeps its end and the suffix its start, 3:1."""
        start = tokenizer.encode("")  # the BOS the tokenizer puts first, if it does
        head = self._extra(tokenizer, extra)
        before = tokenizer.encode_text(prefix)
        after = tokenizer.encode_text(suffix)
        if budget is not None:
            room = max(budget - 3 - len(start), 0)  # the three markers
            head = head[max(len(head) - max(room - len(before) - len(after), 0), 0) :]
            before, after = _cut(before, after, room - len(head))
        if self.suffix_first:
            body = [self.suffix, *after, self.prefix, *before]
        else:
            body = [self.prefix, *before, self.suffix, *after, self.middle]
        return start + head + body

    def _extra(self, tokenizer: Tokenizer, extra: tuple[ExtraFile, ...]) -> list[int]:
        if not extra:
            return []
        ids: list[int] = []
        if self.repo is not None and self.file_sep is not None:
            ids += [self.repo, *tokenizer.encode_text("project\n")]
        for file in extra:
            if self.file_sep is not None:
                name = tokenizer.encode_text(file.filename + "\n")
                ids += [self.file_sep, *name]
            else:
                ids += tokenizer.encode_text(SNIPPET)
            ids += tokenizer.encode_text(file.text)
        if self.file_sep is not None:  # the file being edited comes next (llama.cpp's name)
            ids += [self.file_sep, *tokenizer.encode_text("filename\n")]
        return ids


def _first_id(tokenizer: Tokenizer, spellings: tuple[str, ...]) -> int | None:
    return next((i for t in spellings if (i := tokenizer.token_id(t)) is not None), None)


def _cut(before: list[int], after: list[int], room: int) -> tuple[list[int], list[int]]:
    """The prefix's end and the suffix's start within `room` tokens: each keeps what it
    has while the other leaves room; past that, the prefix gets PREFIX_SHARE."""
    room = max(room, 0)
    if len(before) + len(after) <= room:
        return before, after
    keep_after = min(len(after), max(room - len(before), int(room * (1 - PREFIX_SHARE))))
    keep_before = min(len(before), room - keep_after)
    return before[len(before) - keep_before :], after[:keep_after]
