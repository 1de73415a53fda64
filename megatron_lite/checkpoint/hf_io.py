"""Files of a Hugging Face model folder: ``config.json``, safetensors weights (one file, or shards
with ``model.safetensors.index.json``), and tokenizer files.

Only ``safetensors`` is needed here (not ``transformers``); it is an optional dependency, imported
when a Hugging Face folder is read or written.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil

from ..errors import ConfigError
from .format import CheckpointError

SINGLE_FILE = "model.safetensors"
TOKENIZER_DIR = "tokenizer"  # a converted megatron checkpoint keeps Hugging Face tokenizer files here
INDEX_FILE = "model.safetensors.index.json"
# Tokenizer files copied between a Hugging Face folder and a converted checkpoint when present
# (transformers 4.50+ saves the chat template as chat_template.jinja, beside tokenizer_config.json).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "added_tokens.json", "generation_config.json")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?B)?\s*$", re.IGNORECASE)
_UNITS = {None: 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}


def _safetensors():
    try:
        import safetensors.torch
    except ImportError:
        raise ConfigError("Hugging Face conversion needs the safetensors package; pip install safetensors") from None
    return safetensors.torch


def parse_size(text: str | int) -> int:
    """Bytes of ``5GB`` / ``200MB`` / ``1000`` (decimal units, as Hugging Face uses)."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(str(text))
    size = int(float(m.group(1)) * _UNITS[m.group(2).upper() if m.group(2) else None]) if m else 0
    if size < 1:  # 0 would write every tensor to a file of its own
        raise ConfigError(f"--max-shard-size {text!r} is not a positive size; use e.g. 5GB, 500MB or a byte count")
    return size


def read_json(path: str) -> dict:
    """The JSON object in ``path``; one CheckpointError if it is missing, unreadable or not an object."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} is missing; is {os.path.dirname(path)} a Hugging Face model folder?")
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, ValueError) as err:  # ValueError: JSONDecodeError, UnicodeDecodeError
        raise CheckpointError(f"{path} is not readable JSON ({type(err).__name__}: {str(err).splitlines()[0][:120]}); "
                              "the file is damaged - restore it from the original model") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path} holds a JSON {type(obj).__name__}, not an object; restore it from the original model")
    return obj


def _load_tensor_file(st, path: str, index: str | None = None) -> dict:
    """``safetensors.torch.load_file(path)``; one CheckpointError naming the file if missing or damaged."""
    if not os.path.isfile(path):
        listed = f" (listed in {index})" if index else ""
        raise CheckpointError(f"{path}{listed} is missing; the model folder is incomplete - download it again")
    try:
        return st.load_file(path)
    except Exception as err:  # noqa: BLE001 - safetensors' SafetensorError, OSError: one line, naming the file
        text = str(err).strip().splitlines()
        raise CheckpointError(f"{path} is unreadable ({type(err).__name__}{': ' + text[0][:120] if text else ''}); it is "
                              "truncated or corrupt - download it again") from None


def write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def _save_file(st, tensors: dict, path: str) -> None:
    """``safetensors.save_file``; a failed write (a full disk: a SafetensorError) is an OSError naming ``path``."""
    try:
        st.save_file(tensors, path, metadata={"format": "pt"})
    except OSError:
        raise
    except Exception as err:  # noqa: BLE001 - safetensors reports I/O errors as its own exception type
        raise OSError(errno.EIO, f"write failed ({str(err).strip().splitlines()[0][:120]})", path) from None


def write_safetensors(tensors: dict, folder: str, max_shard_bytes: int, progress=None) -> list[str]:
    """Write ``tensors`` as ``model.safetensors``, or as shards plus the index when larger than
    ``max_shard_bytes``; returns the file names written. ``progress(iterable, desc=, unit=)`` (a
    tqdm-like wrapper) reports each safetensors file as it is written."""
    st = _safetensors()
    os.makedirs(folder, exist_ok=True)
    shards, current, size = [], {}, 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensor.detach().contiguous().clone()  # own storage: safetensors refuses shared views
        size += nbytes
    shards.append(current)
    names = ([SINGLE_FILE] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    files = list(zip(names, shards, strict=True))
    weight_map = {}
    for name, shard in (files if progress is None else progress(files, desc="safetensors files", unit="file")):
        _save_file(st, shard, os.path.join(folder, name))
        weight_map.update(dict.fromkeys(shard, name))
    if len(shards) == 1:
        return [SINGLE_FILE]
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    write_json(os.path.join(folder, INDEX_FILE), {"metadata": {"total_size": total}, "weight_map": weight_map})
    return names + [INDEX_FILE]


def model_files_in(folder: str) -> list[str]:
    """The names of a Hugging Face model's files (config.json, safetensors weights, their index) in ``folder``."""
    if not os.path.isdir(folder):
        return []
    return sorted(n for n in os.listdir(folder) if n in ("config.json", SINGLE_FILE, INDEX_FILE)
                  or re.fullmatch(r"model-\d+-of-\d+\.safetensors", n))


def read_safetensors(folder: str) -> dict:
    """All tensors of a Hugging Face folder (single file or shards listed in the index)."""
    st = _safetensors()
    single, index = os.path.join(folder, SINGLE_FILE), os.path.join(folder, INDEX_FILE)
    if os.path.isfile(single):
        return _load_tensor_file(st, single)
    if os.path.isfile(index):
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no weight_map; restore it from the original model")
        out = {}
        for name in sorted(set(weight_map.values())):
            out.update(_load_tensor_file(st, os.path.join(folder, name), index))
        return out
    raise CheckpointError(f"{folder} has neither {SINGLE_FILE} nor {INDEX_FILE}; only safetensors weights "
                          "are read (convert pytorch_model.bin with transformers first)")


def copy_tokenizer_files(files: dict, folder: str) -> list[str]:
    """Copy ``{target name: source path}`` into ``folder``; returns the names copied."""
    copied = []
    for name, src in files.items():
        if src and os.path.isfile(src):
            os.makedirs(folder, exist_ok=True)
            shutil.copyfile(src, os.path.join(folder, name))
            copied.append(name)
    return copied


def tokenizer_files_in(folder: str) -> dict:
    """``{name: path}`` of the tokenizer files present in a Hugging Face folder."""
    return {name: os.path.join(folder, name) for name in TOKENIZER_FILES if os.path.isfile(os.path.join(folder, name))}
