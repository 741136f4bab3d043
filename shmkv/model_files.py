"""What a process can see of the weights it serves without reading them: a digest of a local
model directory's config files (their bytes) and weight files (their names and sizes). The
integrations (``shmkv.vllm``, ``shmkv.sglang``) put it in the identity replicas of one
store must share, so two engines serving different weights under one model name never
exchange KV. Weights changed in place with the same sizes are not seen (the digest would
need to read every byte); a hub id is named by itself and its revision."""

from __future__ import annotations

import hashlib
import os

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")
CONFIG_FILES = ("config.json", "generation_config.json", "quantize_config.json",
                "quant_config.json", "hf_quant_config.json")


def model_files_digest(model: str) -> str:
    """A digest of a local model directory: its config files' bytes and its weight files'
    names and sizes; for a hub id, ``"hub id"`` (the id and revision name it)."""
    if not os.path.isdir(model):
        return "hub id"
    h = hashlib.sha256()
    for name in sorted(os.listdir(model)):
        path = os.path.join(model, name)
        if name in CONFIG_FILES:
            with open(path, "rb") as f:
                h.update(name.encode() + b"\0" + f.read() + b"\0")
        elif name.endswith(WEIGHT_SUFFIXES):
            h.update(f"{name}\0{os.path.getsize(path)}\0".encode())
    return h.hexdigest()[:16]
