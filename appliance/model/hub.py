"""Models by name: `org/name` or `org/name:QUANT` found in the local Hugging Face cache,
`pull` to fetch one into it, `list_local` for what it holds.

Resolving a name never touches the network: it reads the cache huggingface_hub keeps
(HF_HOME, HF_HUB_CACHE), so a serve starts the same with or without a network. Only
`pull` downloads. A local path keeps working as before and wins over a name.

A repo snapshot with config.json and *.safetensors resolves to its folder; a GGUF repo to
one file: with `:QUANT` the .gguf whose name carries that quant (case-insensitive, as
llama.cpp's -hf and Ollama pick), without one its only GGUF, else Q4_K_M, else Q8_0 (as
llama.cpp defaults), else a refusal that lists the quants. Split GGUFs (-00001-of-0000N)
and vision projectors (mmproj) are not served.

huggingface_hub is imported inside the functions: `appliance --help` stays fast.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("appliance.model")

# Files a safetensors model needs besides its weights (tokenizer, chat template, facts).
FOLDER_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "*.safetensors",
    "model.safetensors.index.json",
)
# Without :QUANT in a repo of several GGUFs, the first of these it has (llama.cpp's order).
DEFAULT_QUANTS = ("Q4_K_M", "Q8_0")
SUPPORTED = "a GGUF file, or config.json with *.safetensors weights"

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_SPLIT = re.compile(r"(?i)-\d{5}-of-\d{5}\.gguf$")
# A quant label among a GGUF file name's parts: Q4_K_M, IQ4_XS, Q8_0, F16, BF16, MXFP4...
_QUANT_PART = re.compile(r"(?i)(i?q\d[a-z0-9_]*|f16|f32|bf16|mxfp4[a-z0-9_]*)")


class ModelNotFound(ValueError):
    """A model by name could not be found, chosen or fetched; str() is one line."""


@dataclass(frozen=True)
class ResolvedModel:
    """What a model setting names: the local file or folder to load and the id to serve
    it under by default (the name the user gave; a local path's file or folder name)."""

    path: Path
    name: str


@dataclass(frozen=True)
class LocalModel:
    """A servable model in the local Hugging Face cache, one revision of one repo."""

    repo_id: str
    commit: str  # the snapshot's commit hash
    refs: tuple[str, ...]  # the branches or tags that point at it ("main")
    kind: str  # "gguf" or "safetensors"
    quants: tuple[str, ...]  # a GGUF repo's quants (file name labels); () for safetensors
    size: int  # bytes on disk
    path: Path  # the snapshot folder


@dataclass(frozen=True)
class _Spec:
    repo_id: str
    quant: str | None

    def __str__(self) -> str:
        return self.repo_id + (f":{self.quant}" if self.quant else "")


def resolve_model(spec: str, revision: str | None = None) -> ResolvedModel:
    """The local file or folder a model setting names: an existing path as it is, else
    `org/name[:QUANT]` from the local Hugging Face cache at `revision` (a branch, tag or
    commit; default main). Raises ModelNotFound (a ValueError) with one line."""
    path = Path(spec).expanduser()
    if path.exists():
        if revision is not None:
            raise ModelNotFound(
                f"a revision ({revision}) applies to a model by name (org/name), "
                f"not to the local path {spec}"
            )
        return ResolvedModel(path, local_name(path))
    parsed = _parse(spec)
    snapshot = _cached_snapshot(parsed.repo_id, revision)
    files = _snapshot_files(snapshot)
    chosen = _choose(parsed, files, f"{parsed} in {snapshot}")
    return ResolvedModel(snapshot / chosen if chosen else snapshot, str(parsed))


def local_name(path: Path) -> str:
    """The id a local model is served under: its file or folder name, less a GGUF quant
    suffix (model_source.model_name's, for any local model)."""
    name = path.name if path.is_dir() else path.stem
    base, _, suffix = name.rpartition(".")
    is_quant = re.fullmatch(r"(?i)i?q\d\w*|f16|f32|bf16", suffix)
    return base if base and is_quant else name


def pull(spec: str, revision: str | None = None) -> Path:
    """Download `org/name[:QUANT]` into the Hugging Face cache (only the files it serves
    from: one GGUF, or the safetensors and the tokenizer, config and chat template files)
    with huggingface_hub's progress bars; the local path resolve_model then gives.
    Raises ModelNotFound with one line when offline, unreachable, gated or absent."""
    from huggingface_hub import HfApi, constants, snapshot_download

    if Path(spec).expanduser().exists():
        raise ModelNotFound(f"{spec} is a local path: there is nothing to pull")
    parsed = _parse(spec)
    if constants.HF_HUB_OFFLINE:
        raise ModelNotFound(
            f"cannot pull {parsed}: HF_HUB_OFFLINE is set (offline mode); unset it to "
            "download, or serve a local GGUF file or folder"
        )
    try:
        # model_info, not list_repo_files: one request, no retries, so an unreachable hub
        # is said at once.
        info = HfApi().model_info(parsed.repo_id, revision=revision, files_metadata=False)
        files = sorted(sibling.rfilename for sibling in info.siblings or [])
        chosen = _choose(parsed, files, f"{parsed} on {constants.ENDPOINT}")
        patterns = [chosen] if chosen else list(FOLDER_FILES)
        snapshot_download(
            parsed.repo_id, revision=revision, cache_dir=cache_dir(), allow_patterns=patterns
        )
    except Exception as exc:
        if isinstance(exc, ModelNotFound):
            raise
        raise ModelNotFound(_pull_failure(parsed, revision, exc)) from None
    return resolve_model(str(parsed), revision).path


def list_local() -> list[LocalModel]:
    """The servable models in the local Hugging Face cache, by repo and revision."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.utils import CacheNotFound

    try:
        cache = scan_cache_dir(cache_dir())
    except CacheNotFound:
        return []
    found = []
    for repo in sorted(cache.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        for rev in sorted(repo.revisions, key=lambda r: r.last_modified, reverse=True):
            names = [str(f.file_path.relative_to(rev.snapshot_path)) for f in rev.files]
            kind = _kind(names)
            if kind is None:
                continue
            quants = tuple(q for q, _ in _ggufs(names)) if kind == "gguf" else ()
            found.append(
                LocalModel(
                    repo.repo_id,
                    rev.commit_hash,
                    tuple(sorted(rev.refs)),
                    kind,
                    quants,
                    rev.size_on_disk,
                    rev.snapshot_path,
                )
            )
    return found


def cache_dir() -> Path:
    """Where huggingface_hub keeps its cache (HF_HUB_CACHE, else HF_HOME/hub)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _parse(spec: str) -> _Spec:
    """`org/name[:QUANT]` (an `hf.co/` prefix, as Ollama takes, allowed), or ModelNotFound
    saying no such path exists for what looks like one."""
    text = re.sub(r"^(https?://)?(hf\.co|huggingface\.co)/", "", spec.strip())
    repo_id, colon, quant = text.partition(":")
    looks_like_path = spec.startswith(("/", ".", "~")) or spec.lower().endswith(".gguf")
    if looks_like_path or not _REPO_ID.fullmatch(repo_id) or (colon and not quant):
        raise ModelNotFound(
            f"no such file or folder: {spec} (a model by name is org/name or org/name:QUANT)"
        )
    return _Spec(repo_id, quant or None)


def _cached_snapshot(repo_id: str, revision: str | None) -> Path:
    """The repo's snapshot folder in the local cache at `revision`, or ModelNotFound."""
    from huggingface_hub import snapshot_download

    try:
        found = snapshot_download(
            repo_id, revision=revision, cache_dir=cache_dir(), local_files_only=True
        )
        return Path(str(found))
    except Exception:  # LocalEntryNotFoundError; anything else means the same to the user
        pass
    at = f" at revision {revision}" if revision else ""
    repo_dir = cache_dir() / ("models--" + repo_id.replace("/", "--"))
    have = sorted(p.name for p in (repo_dir / "refs").glob("*")) if repo_dir.is_dir() else []
    held = f" (it holds {', '.join(have)})" if have else ""
    pull = f"appliance pull {repo_id}" + (f" --revision {revision}" if revision else "")
    raise ModelNotFound(
        f"{repo_id}{at} is not in the local Hugging Face cache {cache_dir()}{held}: "
        f"`{pull}` fetches it (HF_HOME or HF_HUB_CACHE set where the cache is)"
    )


def _snapshot_files(snapshot: Path) -> list[str]:
    """The snapshot's files, relative to it (symlinks into the cache's blobs)."""
    return sorted(str(p.relative_to(snapshot)) for p in snapshot.rglob("*") if p.is_file())


def _kind(names: Iterable[str]) -> str | None:
    """ "safetensors" for config.json with top-level *.safetensors, "gguf" for a GGUF
    we could serve, else None."""
    names = list(names)
    if "config.json" in names and any("/" not in n and n.endswith(".safetensors") for n in names):
        return "safetensors"
    return "gguf" if _ggufs(names) else None


def _ggufs(names: Iterable[str]) -> list[tuple[str, str]]:
    """(quant label, file) of each servable GGUF file: not a vision projector, not a part
    of a split file."""
    out = []
    for name in sorted(names):
        base = name.rsplit("/", 1)[-1]
        if not base.lower().endswith(".gguf") or base.lower().startswith("mmproj"):
            continue
        if _SPLIT.search(base):
            continue
        out.append((quant_label(base), name))
    return out


def quant_label(file_name: str) -> str:
    """The quant a GGUF file's name carries ("Qwen3-0.6B-Q8_0.gguf" -> "Q8_0"), else its
    name less .gguf."""
    stem = file_name.rsplit("/", 1)[-1][: -len(".gguf")]
    for part in reversed(re.split(r"[-.]", stem)):
        if _QUANT_PART.fullmatch(part):
            return part
    return stem


def _choose(spec: _Spec, names: Sequence[str], where: str) -> str | None:
    """The one GGUF file of `names` to serve (relative), or None for a safetensors
    folder; ModelNotFound when there is none, or no single one, of the quant asked for."""
    ggufs = _ggufs(names)
    quants = ", ".join(q for q, _ in ggufs)
    if spec.quant is None:
        if _kind(names) == "safetensors":
            return None
        if len(ggufs) == 1:
            return ggufs[0][1]
        for preferred in DEFAULT_QUANTS:
            matches = [f for q, f in ggufs if q.upper() == preferred]
            if len(matches) == 1:
                log.info("%s: serving its %s quant of %s (%s)", spec, preferred, quants, matches[0])
                return matches[0]
        if ggufs:
            raise ModelNotFound(
                f"{where} has several GGUF quants ({quants}) and no {' or '.join(DEFAULT_QUANTS)}: "
                f"name one, e.g. {spec.repo_id}:{ggufs[0][0]}"
            )
        raise ModelNotFound(_no_weights(where, names))
    if not ggufs:
        split = [n for n in names if _SPLIT.search(n)]
        if split:
            raise ModelNotFound(_split_refusal(where, split))
        if _kind(names) == "safetensors":
            raise ModelNotFound(
                f"{where} has safetensors weights, no GGUF quants: "
                f"drop :{spec.quant} to serve its folder"
            )
        raise ModelNotFound(_no_weights(where, names))
    matches = _quant_matches(spec.quant, ggufs)
    if len(matches) == 1:
        return matches[0]
    split = [n for n in names if _SPLIT.search(n) and spec.quant.lower() in n.lower()]
    if not matches and split:
        raise ModelNotFound(_split_refusal(where, split))
    if matches:
        raise ModelNotFound(
            f"{where}: several GGUF files carry quant {spec.quant} ({', '.join(matches)}); "
            "serve one by its path"
        )
    raise ModelNotFound(f"{where} has no GGUF of quant {spec.quant} (it has: {quants})")


def _quant_matches(quant: str, ggufs: list[tuple[str, str]]) -> list[str]:
    """The files whose quant label is `quant`, else those whose name holds it as a word
    (not Q4_K inside Q4_K_M), else those whose name holds it at all; case-insensitive."""
    exact = [f for q, f in ggufs if q.lower() == quant.lower()]
    if exact:
        return exact
    word = re.compile(rf"(?i)(?<![a-z0-9]){re.escape(quant)}(?![a-z0-9_])")
    worded = [f for _, f in ggufs if word.search(f.rsplit("/", 1)[-1])]
    if worded:
        return worded
    return [f for _, f in ggufs if quant.lower() in f.rsplit("/", 1)[-1].lower()]


def _no_weights(where: str, names: Sequence[str]) -> str:
    shown = ", ".join(names[:12]) + (f" and {len(names) - 12} more" if len(names) > 12 else "")
    return (
        f"{where} has no weights the appliance can load "
        f"(files: {shown or 'none'}; supported: {SUPPORTED})"
    )


def _split_refusal(where: str, split: Sequence[str]) -> str:
    return (
        f"{where} holds a split GGUF ({split[0]}, ...), which the appliance does not load: "
        "merge it with llama.cpp's `llama-gguf-split --merge` and serve the merged file"
    )


def _pull_failure(spec: _Spec, revision: str | None, exc: Exception) -> str:
    """One line for why a download failed."""
    from huggingface_hub import constants
    from huggingface_hub.utils import (
        GatedRepoError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(exc, GatedRepoError):
        return (
            f"cannot pull {spec}: the repo is gated; accept its terms on the hub and set "
            "HF_TOKEN (or run `hf auth login`)"
        )
    if isinstance(exc, RepositoryNotFoundError):
        return (
            f"cannot pull {spec}: no such repo on {constants.ENDPOINT} "
            "(or it is private: set HF_TOKEN)"
        )
    if isinstance(exc, RevisionNotFoundError):
        return f"cannot pull {spec}: it has no revision {revision}"
    if isinstance(exc, OfflineModeIsEnabled):
        return f"cannot pull {spec}: HF_HUB_OFFLINE is set (offline mode)"
    reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return (
        f"cannot pull {spec}: the hub at {constants.ENDPOINT} is not reachable "
        f"({type(exc).__name__}: {reason}); check the network or HF_ENDPOINT, or serve a "
        "local GGUF file or folder"
    )
