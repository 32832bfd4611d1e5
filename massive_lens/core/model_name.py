"""A model's name for people, from a hub id or a local path."""

from __future__ import annotations

import os
from pathlib import PurePath

__all__ = ["readable_name"]


def readable_name(name: str) -> str:
    """A model's name for people: a hub id stays as it is; a local path (a folder saved with
    ``save_pretrained``, a file, a hub cache snapshot) becomes the name it stands for.

    >>> readable_name("gpt2"), readable_name("Qwen/Qwen2.5-0.5B")
    ('gpt2', 'Qwen/Qwen2.5-0.5B')
    >>> readable_name("/home/me/.cache/huggingface/hub/models--Qwen--Qwen2.5-0.5B/snapshots/4f2c1e/")
    'Qwen/Qwen2.5-0.5B'
    >>> readable_name("/data/checkpoints/my-model-v2"), readable_name("./runs/model.gguf")
    ('my-model-v2', 'model')
    """
    text = str(name).strip().rstrip("/\\")
    parts = PurePath(text).parts
    hub = [p for p in parts if p.startswith("models--")]  # the hub cache: models--ORG--NAME/snapshots/HASH
    if hub:
        return hub[-1].removeprefix("models--").replace("--", "/")
    is_path = (text.startswith(("/", "~", ".", "\\")) or PurePath(text).is_absolute() or len(parts) > 2
               or os.path.exists(text))
    if not is_path or not parts:
        return text
    stem = PurePath(text).name
    return stem.removesuffix(".gguf") if stem.endswith(".gguf") else stem
