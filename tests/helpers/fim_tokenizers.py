"""The embedded model's tokenizer with some of its special tokens renamed to a code
family's fill-in-the-middle markers: no FIM-trained model is on this machine, and a
random-weight model of SmolLM2's vocabulary with this tokenizer is served as one would be
(tests/chat/test_fill_in_middle.py, tests/server/test_infill.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from appliance.model.model_source import prepare_model
from appliance.settings.config import load_settings

# SmolLM2's ids 3..14 are <repo_name>, <reponame>, <file_sep>, ..., <jupyter_*>: renamed.
STYLES: dict[str, dict[int, str]] = {
    "qwen": {
        11: "<|fim_prefix|>",
        12: "<|fim_suffix|>",
        13: "<|fim_middle|>",
        14: "<|fim_pad|>",
        3: "<|repo_name|>",
        5: "<|file_sep|>",
    },
    "starcoder": {11: "<fim_prefix>", 12: "<fim_suffix>", 13: "<fim_middle>", 14: "<fim_pad>"},
    # Codestral's: suffix first, and no file markers (SmolLM2's renamed away)
    "codestral": {11: "[PREFIX]", 12: "[SUFFIX]", 13: "[MIDDLE]", 3: "<x_repo>", 5: "<x_sep>"},
}


def fim_tokenizer(folder: Path, style: str, bos: bool = False) -> Path:
    """SmolLM2's tokenizer files in `folder`, `style`'s markers in place of its tokens;
    with `bos`, encoding puts <|endoftext|> (id 0) first, as CodeLlama's puts its BOS."""
    source = prepare_model(None, load_settings().cache_dir)[1]
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        if (source / name).is_file():
            shutil.copy(source / name, folder / name)
    data = json.loads((source / "tokenizer.json").read_text())
    renamed = STYLES[style]
    vocab = data["model"]["vocab"]
    old = {i: t for t, i in vocab.items() if i in renamed}
    for token_id, new in renamed.items():
        del vocab[old[token_id]]
        vocab[new] = token_id
    for added in data["added_tokens"]:
        if added["id"] in renamed:
            added["content"] = renamed[added["id"]]
    if bos:
        first = {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}
        data["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [first, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [
                first,
                {"Sequence": {"id": "A", "type_id": 0}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {
                "<|endoftext|>": {"id": "<|endoftext|>", "ids": [0], "tokens": ["<|endoftext|>"]}
            },
        }
    (folder / "tokenizer.json").write_text(json.dumps(data))
    return folder
