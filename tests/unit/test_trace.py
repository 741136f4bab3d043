"""Trace formats (shmkv/serve/trace.py): the Mooncake reader, format detection, malformed
lines, the infinite-cache bound, the sweep's table and JSON; no process is started."""

from __future__ import annotations

import json

import pytest

from shmkv.errors import UsageError
from shmkv.serve import sweep
from shmkv.serve.trace import (
    block_tokens,
    detect_format,
    infinite_cache_bound,
    load_trace,
    read_mooncake,
)
from shmkv.serve.workload import TraceRequest, read_trace, write_trace


def _mooncake(path, lines) -> str:
    path.write_text("".join((json.dumps(x) if isinstance(x, dict) else x) + "\n"
                            for x in lines))
    return str(path)


def _line(ids, input_length=None, output_length=4, timestamp=0):
    return {"timestamp": timestamp, "input_length": input_length or 512 * len(ids),
            "output_length": output_length, "hash_ids": ids}


def test_block_tokens_equal_ids_equal_tokens_in_vocabulary():
    a = block_tokens(7, 16, 97)
    assert a == block_tokens(7, 16, 97) and len(a) == 16
    assert all(1 <= t < 97 for t in a)
    assert a != block_tokens(8, 16, 97)
    assert len(block_tokens(7, 64, 97)) == 64  # more than one digest's worth
    blocks = {tuple(block_tokens(h, 16, 97)) for h in range(5000)}
    assert len(blocks) == 5000


def test_mooncake_scaling_capping_and_arrivals(tmp_path):
    path = _mooncake(tmp_path / "m.jsonl", [
        _line([0, 1, 2], input_length=1100, output_length=500, timestamp=0),  # 35 tokens
        _line(list(range(10, 50)), output_length=64, timestamp=1500),  # 640 tokens: capped
        '',
        _line([0, 1, 2, 3], input_length=1536 + 1, output_length=0, timestamp=2500),
    ])
    w, info = read_mooncake(path, block_size=16, vocab_size=97, max_model_len=512)
    assert [t.request_id for t in w] == ["m1", "m2", "m4"]
    a, b, c = w
    assert len(a.prompt_token_ids) == 35 and a.max_tokens == 16  # ceil(1100/32), 500/32
    assert a.prompt_token_ids == (block_tokens(0, 16, 97) + block_tokens(1, 16, 97)
                                  + block_tokens(2, 16, 97))[:35]
    assert len(b.prompt_token_ids) == 512 - 2 and b.max_tokens == 2  # capped
    assert c.max_tokens == 1 and len(c.prompt_token_ids) == 49  # the 4th id's first token
    assert c.prompt_token_ids[:48] == a.prompt_token_ids[:32] + block_tokens(2, 16, 97)
    assert [t.arrival_s for t in w] == [0.0, 1.5, 2.5]
    assert info.capped == 1 and info.scale == 16 / 512 and info.requests == 3
    assert "16/512" in info.text() and "1 requests capped" in info.text()
    # --trace-block-tokens: one id = 16 tokens in the trace too, no scaling.
    path = _mooncake(tmp_path / "m16.jsonl", [_line([5, 6], input_length=32)])
    w, info = read_mooncake(path, block_size=16, vocab_size=97, max_model_len=4096,
                            trace_block_tokens=16)
    assert info.scale == 1.0 and len(w[0].prompt_token_ids) == 32 and w[0].max_tokens == 4


def test_detect_format_and_load_both(tmp_path):
    m = _mooncake(tmp_path / "m.jsonl", ["", _line([1, 2])])
    assert detect_format(m) == "mooncake"
    s = tmp_path / "s.jsonl"
    write_trace(s, [TraceRequest(request_id="a", prompt_token_ids=[1, 2, 3], max_tokens=2)])
    assert detect_format(s) == "shmkv"
    w, info = load_trace(s, None, block_size=16, vocab_size=97, max_model_len=512)
    assert info.format == "shmkv" and w[0].prompt_token_ids == [1, 2, 3]
    w, info = load_trace(m, None, block_size=16, vocab_size=97, max_model_len=512)
    assert info.format == "mooncake" and len(w[0].prompt_token_ids) == 32
    with pytest.raises(UsageError, match="not a trace request"):  # told the wrong format
        load_trace(m, "shmkv", block_size=16, vocab_size=97, max_model_len=512)
    with pytest.raises(UsageError, match="--trace-format"):
        load_trace(m, "csv", block_size=16, vocab_size=97, max_model_len=512)


@pytest.mark.parametrize("line, field", [
    ('{"timestamp": 0, "input_length": 512, "output_length": 1}', "field hash_ids is missing"),
    ('{"timestamp": 0, "output_length": 1, "hash_ids": [1]}', "field input_length is missing"),
    ('{"timestamp": 0, "input_length": -5, "output_length": 1, "hash_ids": [1]}',
     "field input_length must be >= 1"),
    ('{"timestamp": 0, "input_length": 5, "output_length": -1, "hash_ids": [1]}',
     "field output_length must be >= 0"),
    ('{"timestamp": 0, "input_length": 1025, "output_length": 1, "hash_ids": [1, 2]}',
     "field hash_ids has 2 ids, input_length 1025 needs 3"),
    ('{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1, "x"]}',
     "field hash_ids[1]"),
    ('{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1.5]}',
     "field hash_ids[0]"),
    ('{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [-3]}',
     "field hash_ids[0] is negative"),
    ('{"timestamp": "soon", "input_length": 512, "output_length": 1, "hash_ids": [1]}',
     "field timestamp"),
    ('{"timestamp": 0, "input_length": 512', "not JSON"),
])
def test_malformed_mooncake_lines_name_file_line_and_field(tmp_path, line, field):
    path = _mooncake(tmp_path / "bad.jsonl", [_line([1]), line])
    with pytest.raises(UsageError) as e:
        read_mooncake(path, block_size=16, vocab_size=97, max_model_len=512)
    assert "bad.jsonl:2: " in str(e.value) and field in str(e.value), str(e.value)


def test_shmkv_trace_arrival_round_trip_and_check(tmp_path):
    w = [TraceRequest(request_id="a", prompt_token_ids=[1, 2], arrival_s=0.5),
         TraceRequest(request_id="b", prompt_token_ids=[3])]
    path = tmp_path / "t.jsonl"
    write_trace(path, w)
    assert read_trace(path) == w
    assert "arrival_s" not in path.read_text().splitlines()[1]  # defaults left out
    path.write_text('{"request_id": "a", "prompt_token_ids": [1], "arrival_s": -1}\n')
    with pytest.raises(UsageError, match="t.jsonl:1: arrival_s must be >= 0"):
        read_trace(path)


def test_infinite_cache_bound_hand_checked():
    """Three requests of 5 blocks sharing their k = 3 leading blocks: the 2nd and 3rd hit
    3 blocks each; a 4th equal to the 1st hits 4 (its last token must be computed), a
    salted copy nothing."""
    bs = 4

    def blk(h):
        return [h * 10 + j for j in range(bs)]

    def prompt(*ids):
        return [t for h in ids for t in blk(h)]

    reqs = [(prompt(1, 2, 3, 4, 5), None, None), (prompt(1, 2, 3, 6, 7), None, None),
            (prompt(1, 2, 3, 8, 9), None, None), (prompt(1, 2, 3, 4, 5), None, None),
            (prompt(1, 2, 3, 4, 5), None, "tenant")]
    b = infinite_cache_bound(reqs, bs)
    assert b["prompt_tokens"] == 5 * 20
    assert b["prefill_tokens_saved"] == (3 + 3 + 4) * bs
    # A block equal to an earlier one but under another prefix is not a hit.
    b = infinite_cache_bound([(prompt(1, 2), None, None), (prompt(3, 2), None, None)], bs)
    assert b["prefill_tokens_saved"] == 0
    # Computed tokens (a conversation's output) count for later prompts.
    first = prompt(1, 2) + [99, 98]
    b = infinite_cache_bound([(first, first + [97, 96], None),
                              (first + [97, 96] + prompt(5), None, None)], bs)
    assert b["prefill_tokens_saved"] == 3 * bs


def test_sweep_table_json_and_configurations(tmp_path):
    assert sweep.configurations("shared", "prefix-aware") == [
        ("shared", "prefix-aware"), ("private", "sglang-cache-aware"),
        ("private", "llm-d-scorer"), ("private", "round-robin")]
    assert sweep.configurations("private", "llm-d-scorer") == [
        ("private", "llm-d-scorer"), ("shared", "prefix-aware"),
        ("private", "sglang-cache-aware"), ("private", "round-robin")]
    fig = dict.fromkeys(sweep.ROW_FIELDS, 0)
    fig.update(pool="shared", routing="round-robin", schedulers=4, num_blocks=2048,
               block_size=16, prefix_hit_rate=0.25, prompt_tokens=400,
               prefill_tokens_saved=100, ttft_steps_mean=1.5, ttft_steps_p99=4, wall_s=1.0,
               extra="dropped")
    bound = {"prompt_tokens": 400, "prefill_tokens_saved": 160, "prefix_hit_rate": 0.4}
    rows = [sweep.row(fig, bound), sweep.row(dict(fig, num_blocks=8192), bound)]
    assert "extra" not in rows[0] and rows[0]["infinite_cache_hit_rate"] == 0.4
    text = sweep.sweep_table(rows, bound)
    assert "infinite cache (bound)" in text and "40.0%" in text and "8,192" in text
    sweep.sweep_json(rows, bound, None, str(tmp_path / "s.json"))
    got = json.loads((tmp_path / "s.json").read_text())
    assert len(got["runs"]) == 2 and got["infinite_cache_bound"] == bound
    pytest.importorskip("matplotlib")
    sweep.plot_sweep(rows, bound, str(tmp_path / "s.png"))
    assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
