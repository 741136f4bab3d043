"""Local model directories on real files, for the tests of the weights' digest
(``shmkv/model_files.py``) and of the identities that hold it: a sharded safetensors
checkpoint, its copies, and a byte changed in place."""

from __future__ import annotations

import json
import os
import random
import shutil
import struct

from shmkv.model_files import NUM_WINDOWS, sample_windows

F16_BYTES = 2
SHARDS = {  # a sharded checkpoint: shard name -> {tensor: shape}, all float16
    "model-00001-of-00002.safetensors": {"embed.weight": [1024, 1024],
                                         "layers.0.weight": [1024, 1024]},
    "model-00002-of-00002.safetensors": {"lm_head.weight": [1024, 2048]},
}


def make_safetensors(path: str, shapes: dict[str, list[int]], seed: int) -> None:
    """A safetensors file: the 8-byte little-endian header length, the JSON header (padded
    with spaces to 8 bytes, as safetensors writes it), then random float16 bytes."""
    header: dict = {"__metadata__": {"format": "pt"}}
    at = 0
    for name, shape in shapes.items():
        nbytes = F16_BYTES * shape[0] * shape[1]
        header[name] = {"dtype": "F16", "shape": shape, "data_offsets": [at, at + nbytes]}
        at += nbytes
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob + random.Random(seed).randbytes(at))


def make_model_dir(path: str, seed: int = 0) -> str:
    """A two-shard safetensors checkpoint: config.json, the shards and their index."""
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "torch_dtype": "float16"}, f)
    weight_map = {}
    for i, (shard, shapes) in enumerate(SHARDS.items()):
        make_safetensors(os.path.join(path, shard), shapes, seed + i)
        weight_map.update(dict.fromkeys(shapes, shard))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 12 << 20}, "weight_map": weight_map}, f)
    return path


def data_at(path: str) -> int:
    """Where a safetensors file's tensor bytes start."""
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def flip_byte(path: str, offset: int) -> None:
    """Inverts the byte at ``offset`` in place (the file keeps its size)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        old = f.read(1)
        f.seek(offset)
        f.write(bytes([old[0] ^ 0xFF]))


def copy_of(model: str, to: str) -> str:
    """A copy of the directory ``model`` at ``to``, byte for byte."""
    shutil.copytree(model, to)
    return to


def tuned_copy(model: str, to: str) -> str:
    """A copy of ``model`` whose last shard differs in one byte of a sampled window (its
    middle one): the same file names, sizes and safetensors headers, other weights."""
    copy_of(model, to)
    shard = os.path.join(to, list(SHARDS)[-1])
    offset, _ = sample_windows(data_at(shard), os.path.getsize(shard))[NUM_WINDOWS // 2]
    flip_byte(shard, offset)
    return to
