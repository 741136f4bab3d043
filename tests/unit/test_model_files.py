"""The digest of a local model directory (``shmkv/model_files.py``) on real files: the same
weights at another path give the same digest; a byte changed in a sampled window, another
safetensors header of the same size, or another index changes it; a change between two
windows does not (the documented blind spot); a 4 GiB shard is read only in its windows."""

from __future__ import annotations

import os
import shutil

import pytest

from shmkv.model_files import (
    HUB_ID,
    NUM_WINDOWS,
    WINDOW_BYTES,
    model_files_digest,
    sample_windows,
)
from tests.model_dirs import copy_of, data_at, flip_byte, make_model_dir, make_safetensors


def test_the_windows_are_evenly_spaced_from_the_data_to_the_end():
    """NUM_WINDOWS windows, the first at the data's start, the last ending at the file's end,
    evenly spaced; data no longer than all the windows is read whole; no data, nothing."""
    assert (NUM_WINDOWS, WINDOW_BYTES) == (16, 64 << 10)
    size = WINDOW_BYTES + 15 * (128 << 10)  # a step of exactly 128 KiB: gaps of 64 KiB
    assert sample_windows(0, size) == [(i * (128 << 10), WINDOW_BYTES) for i in range(16)]
    assert sample_windows(40, 40 + size) == [(40 + i * (128 << 10), WINDOW_BYTES)
                                             for i in range(16)]
    assert sample_windows(100, 100 + (1 << 20)) == [(100, 1 << 20)]
    assert sample_windows(100, 100) == []


def test_the_same_weights_at_another_path_have_the_same_digest(tmp_path):
    """A copy of the directory, and a directory of symlinks to its files (a hub cache
    snapshot), have the directory's digest."""
    model = make_model_dir(str(tmp_path / "model"))
    links = tmp_path / "snapshot"
    links.mkdir()
    for name in os.listdir(model):
        (links / name).symlink_to(os.path.join(model, name))
    digest = model_files_digest(model)
    assert len(digest) == 16 and digest != HUB_ID
    assert model_files_digest(copy_of(model, str(tmp_path / "elsewhere"))) == digest
    assert model_files_digest(str(links)) == digest


@pytest.mark.parametrize("window", [0, 7, NUM_WINDOWS - 1])
def test_a_byte_changed_in_a_sampled_window_changes_the_digest(tmp_path, window):
    """The same file names, sizes and headers with one byte changed in a window (the
    first, a middle one, the last byte of the file) of the second shard: another digest."""
    model = make_model_dir(str(tmp_path / "model"))
    other = copy_of(model, str(tmp_path / "tuned"))
    shard = os.path.join(other, "model-00002-of-00002.safetensors")
    offset, length = sample_windows(data_at(shard), os.path.getsize(shard))[window]
    flip_byte(shard, offset + length - 1 if window == NUM_WINDOWS - 1 else offset)
    assert os.path.getsize(shard) == os.path.getsize(shard.replace(other, model))
    assert model_files_digest(other) != model_files_digest(model)


def test_a_change_between_two_windows_is_not_seen(tmp_path):
    """A byte changed in place between two windows leaves the digest as it was: the blind
    spot the module docstring states; the bytes either side of the gap are seen."""
    model = make_model_dir(str(tmp_path / "model"))
    shard = os.path.join(model, "model-00001-of-00002.safetensors")
    windows = sample_windows(data_at(shard), os.path.getsize(shard))
    (first, length), (second, _) = windows[0], windows[1]
    assert second - (first + length) > 0  # a 4 MiB shard has gaps
    digest = model_files_digest(model)
    flip_byte(shard, first + length)  # the gap's first byte
    assert model_files_digest(model) == digest
    flip_byte(shard, first + length - 1)  # the window's last byte
    assert model_files_digest(model) != digest


def test_another_safetensors_header_of_the_same_size_changes_the_digest(tmp_path):
    """Transposed shapes (the same bytes, header length and file size): another digest."""
    model = make_model_dir(str(tmp_path / "model"))
    other = tmp_path / "transposed"
    other.mkdir()
    for name in os.listdir(model):
        if name != "model-00002-of-00002.safetensors":
            shutil.copy(os.path.join(model, name), other / name)
    make_safetensors(str(other / "model-00002-of-00002.safetensors"),
                     {"lm_head.weight": [2048, 1024]}, seed=1)
    shard = "model-00002-of-00002.safetensors"
    assert os.path.getsize(other / shard) == os.path.getsize(os.path.join(model, shard))
    assert model_files_digest(str(other)) != model_files_digest(model)


def test_the_index_of_a_sharded_checkpoint_is_read(tmp_path):
    """Another weight map in ``*.index.json`` (the same length): another digest."""
    model = make_model_dir(str(tmp_path / "model"))
    other = copy_of(model, str(tmp_path / "remapped"))
    index = os.path.join(other, "model.safetensors.index.json")
    with open(index) as f:
        text = f.read()
    with open(index, "w") as f:
        f.write(text.replace("00001-of-00002", "00002-of-00002", 1))
    assert model_files_digest(other) != model_files_digest(model)


def test_a_safetensors_file_without_a_header_is_read_from_its_first_byte(tmp_path):
    """A small weight file that is not valid safetensors is read whole."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(bytes(1000))
    digest = model_files_digest(str(model))
    flip_byte(str(model / "model.safetensors"), 999)
    assert model_files_digest(str(model)) != digest


def _bytes_read() -> int | None:
    """This process's bytes read by read-like system calls so far (Linux), else None."""
    try:
        with open("/proc/self/io") as f:
            fields = dict(line.split(": ") for line in f.read().splitlines())
    except OSError:
        return None
    return int(fields["rchar"])


def test_a_4_gib_shard_is_read_only_in_its_windows(tmp_path):
    """A 4 GiB sparse safetensors shard: the digest reads its windows (1 MiB and the config,
    where /proc/self/io says), and sees a byte written in its middle window."""
    model = tmp_path / "big"
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    shard = model / "model.safetensors"
    with open(shard, "wb") as f:
        f.truncate(4 << 30)
    try:
        before = _bytes_read()
        digest = model_files_digest(str(model))
        after = _bytes_read()
        if before is not None and after is not None:
            assert after - before <= NUM_WINDOWS * WINDOW_BYTES + 4096
        offset, _ = sample_windows(0, 4 << 30)[NUM_WINDOWS // 2]
        with open(shard, "r+b") as f:
            f.seek(offset)
            f.write(b"\1")
        assert model_files_digest(str(model)) != digest
    finally:
        shard.unlink()
