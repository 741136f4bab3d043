"""What a process can see of the weights it serves without reading them: a digest of a
local model directory, and the identity fields that name the weights. The integrations
(``shmkv.vllm``, ``shmkv.sglang``) put them in the identity the replicas of one store must
share, so two engines serving different weights never exchange KV, and the same weights
at another path (a copy, another mount, a cache snapshot's symlinks) share the store.

What the digest reads, for each file directly in the directory (not its subdirectories):

- the config files (``CONFIG_FILES``): their bytes;
- each weight file (``WEIGHT_SUFFIXES``, sharded checkpoints' shards and ``*.index.json``
  included): its name and size; for ``.safetensors`` its header (the 8-byte little-endian
  length, then the JSON naming every tensor's dtype, shape and byte offsets, and the
  ``__metadata__``); then samples of its data: ``NUM_WINDOWS`` windows of
  ``WINDOW_BYTES`` evenly spaced from the start of the data (after a safetensors header)
  to the end of the file, the last one ending at the file's end. A file whose data is at
  most ``NUM_WINDOWS * WINDOW_BYTES`` long is read whole.

So a file reads at most its safetensors header plus 1 MiB, whatever its size (a 1 GiB
shard, measured on a 2-core VM: 0.7-1.7 ms in the page cache, 3.5-6.3 ms cold). Weights
fine-tuned with the same shapes differ in every window but by chance; a file with another
header or size differs outright. A ``.safetensors`` file without a valid header is sampled
from its first byte.

What it cannot see: a change in place (the same size and header) confined to the bytes
between two windows: gaps of ``(data - NUM_WINDOWS * WINDOW_BYTES) / (NUM_WINDOWS - 1)``
bytes, about 68 MiB in a 1 GiB shard. A tensor rewritten whole that is longer than a gap
always crosses a window. Nor are files in subdirectories or of other names read (tokenizer
files, LoRA adapters loaded at run time).

A hub id (not a local directory) is named by itself and its revision: its digest is
``HUB_ID``, and the id itself is compared.
"""

from __future__ import annotations

import hashlib
import os
import struct

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")
CONFIG_FILES = ("config.json", "generation_config.json", "quantize_config.json",
                "quant_config.json", "hf_quant_config.json")
WINDOW_BYTES = 64 << 10
NUM_WINDOWS = 16  # evenly spaced over a file's data, the first at its start, the last at its end
SAFETENSORS_HEADER_MAX = 100 << 20  # the format's own limit on its JSON header
HUB_ID = "hub id"  # the digest of a model that is not a local directory

# The identity fields that are recorded and shown when replicas are refused, never compared:
# the weights' digest is their identity, the path is where this replica found them.
SHOWN_FIELDS = frozenset({"model_dir"})
LOCAL_DIR = "local directory (model_files names its weights)"


def differing_fields(recorded: dict, mine: dict, names: list[str]) -> list[str]:
    """Of ``names``, the fields whose values differ between two identities, then (only if
    any do) the shown fields, which a refusal names beside them and never compares."""
    differ = [k for k in names if k not in SHOWN_FIELDS and recorded.get(k) != mine.get(k)]
    return differ + [k for k in names if k in SHOWN_FIELDS] if differ else []


def shown_note(fields: list[str]) -> str:
    """What a refusal adds after the fields it names: which of them were only shown."""
    shown = [k for k in fields if k in SHOWN_FIELDS]
    return f" ({', '.join(shown)} shown, not compared)" if shown else ""


def weights_fields(model: str, name_field: str) -> dict[str, str]:
    """The identity fields naming the weights at ``model``: for a hub id, ``name_field`` is
    the id (compared) and ``model_files`` is ``HUB_ID``; for a local directory,
    ``name_field`` says so, ``model_files`` is its digest (compared) and ``model_dir`` its
    path (shown, not compared: ``SHOWN_FIELDS``)."""
    if not os.path.isdir(model):
        return {name_field: model, "model_files": HUB_ID}
    return {name_field: LOCAL_DIR, "model_dir": model, "model_files": model_files_digest(model)}


def model_files_digest(model: str) -> str:
    """A digest of a local model directory (what the module docstring says it reads); for
    a hub id, ``HUB_ID``.

    Raises:
        OSError: a file of the directory cannot be read.
    """
    if not os.path.isdir(model):
        return HUB_ID
    h = hashlib.sha256()
    for name in sorted(os.listdir(model)):
        path = os.path.join(model, name)
        if name in CONFIG_FILES:
            with open(path, "rb") as f:
                h.update(name.encode() + b"\0" + f.read() + b"\0")
        elif name.endswith(WEIGHT_SUFFIXES) and os.path.isfile(path):
            _weight_file(h, name, path)
    return h.hexdigest()[:16]


def _weight_file(h: hashlib._Hash, name: str, path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        h.update(f"{name}\0{size}\0".encode())
        data_at = 0
        if name.endswith(".safetensors"):
            header = _safetensors_header(fd, size)
            h.update(b"header\0" + header + b"\0")
            data_at = 8 + len(header) if header else 0
        for offset, length in sample_windows(data_at, size):
            h.update(os.pread(fd, length, offset))
    finally:
        os.close(fd)


def _safetensors_header(fd: int, size: int) -> bytes:
    """The JSON header of a safetensors file; ``b""`` if it has none (then only its windows
    are read)."""
    head = os.pread(fd, 8, 0)
    if len(head) < 8:
        return b""
    (length,) = struct.unpack("<Q", head)
    if not 0 < length <= min(size - 8, SAFETENSORS_HEADER_MAX):
        return b""
    header = os.pread(fd, length, 8)
    return header if header[:1] == b"{" else b""


def sample_windows(data_at: int, size: int) -> list[tuple[int, int]]:
    """The (offset, length) windows read of a file's data ``[data_at, size)``: all of it if
    it is at most ``NUM_WINDOWS * WINDOW_BYTES`` long, else ``NUM_WINDOWS`` windows evenly
    spaced, the first at ``data_at``, the last ending at ``size``."""
    span = size - data_at
    if span <= NUM_WINDOWS * WINDOW_BYTES:
        return [(data_at, span)] if span > 0 else []
    step = (span - WINDOW_BYTES) / (NUM_WINDOWS - 1)
    return [(data_at + round(i * step), WINDOW_BYTES) for i in range(NUM_WINDOWS)]

