"""The checks of run / replay arguments (``shmkv/cli/run_args.py``): each names the argument,
the value and the rule; the longest request of a workload counts its conversation's history;
the pool must hold one request. And the words of the comparison (``shmkv/serve/report.py``):
the intro, one line per run, the table with the shared pool's saving, the replay's lock wait,
the plot's title, and the plot file's mode."""

from __future__ import annotations

import math
import os

import pytest

from shmkv.cli import build_parser
from shmkv.cli.run_args import check_arguments, check_fits, longest_request, parse_blocks
from shmkv.errors import UsageError
from shmkv.serve import report
from shmkv.serve.workload import TraceRequest


@pytest.mark.parametrize("text, caps", [("512", [512]), ("2048,8192", [2048, 8192]),
                                        (" 16 , 32 ", [16, 32])])
def test_blocks_parse(text, caps):
    """One number of blocks, or several separated by commas (spaces allowed)."""
    assert parse_blocks(text) == caps


@pytest.mark.parametrize("text, message", [
    ("abc", "--blocks 'abc': 'abc' is not a whole number; give a number of blocks >= 16"),
    ("2048,x", "--blocks '2048,x': 'x' is not a whole number"),
    ("8", "--blocks '8': 8 is under 16"),
    ("2048,-1", "--blocks '2048,-1': -1 is under 16"),
    ("", "--blocks '': no number"),
    ("16,,32", "--blocks '16,,32': an empty item between commas"),
])
def test_blocks_refused_naming_value_and_rule(text, message):
    with pytest.raises(UsageError) as e:
        parse_blocks(text)
    assert str(e.value).startswith(message)


def _args(*argv: str):
    return build_parser().parse_args(list(argv))


@pytest.mark.parametrize("argv, message", [
    (["--schedulers", "0"], "--schedulers 0: must be a whole number >= 1"),
    (["--block-size", "0"], "--block-size 0: must be a whole number >= 1"),
    (["--max-num-batched-tokens", "-3"], "--max-num-batched-tokens -3: must be a whole"),
    (["--concurrency", "0"], "--concurrency 0: must be a whole number >= 1"),
    (["--conversations", "0"], "--conversations 0: must be a whole number >= 1"),
    (["--trace-block-tokens", "0"], "--trace-block-tokens 0: must be a whole number"),
    (["--max-model-len", "0"], "--max-model-len 0: must be a whole number >= 1"),
    (["--time-scale", "nan"], "--time-scale nan: must be a finite number >= 0"),
    (["--time-scale", "inf"], "--time-scale inf: must be a finite number >= 0"),
    (["--timeout", "-1"], "--timeout -1.0: must be a finite number of seconds > 0"),
    (["--rank-nice", "-1"], "--rank-nice -1: must be a whole number from 0 to 19"),
    (["--trace-format", "shmkv"], "--trace-format 'shmkv': needs --trace PATH"),
    (["--kill-one", "--schedulers", "1"], "--kill-one with --schedulers 1: needs at least 2"),
    (["--rolling-restart", "--schedulers", "1"], "--rolling-restart with --schedulers 1: "),
    (["--restart-one", "--kill-one"], "--kill-one and --restart-one: give one of them"),
    (["--cache-threshold", "1.2"], "--cache-threshold 1.2: must be between 0 and 1"),
    (["--balance-abs-threshold", "-1"], "--balance-abs-threshold -1: must be a whole number"),
    (["--balance-rel-threshold", "0.9"], "--balance-rel-threshold 0.9: must be a finite"),
    (["--queue-scorer-weight", "-2"], "--queue-scorer-weight -2.0: must be a finite number"),
])
def test_every_number_option_is_checked(argv, message):
    """run's options: the first one that breaks its rule, with its value and the rule."""
    with pytest.raises(UsageError) as e:
        check_arguments(_args("run", *argv))
    assert str(e.value).startswith(message)


@pytest.mark.parametrize("argv, message", [
    (["--prefill-ms-per-token", "-0.1"], "--prefill-ms-per-token -0.1: must be a finite"),
    (["--decode-ms-per-step", "inf"], "--decode-ms-per-step inf: must be a finite number"),
])
def test_replay_cost_model_is_checked(argv, message):
    """A negative or infinite cost is refused, naming the flag."""
    with pytest.raises(UsageError) as e:
        check_arguments(_args("replay", *argv))
    assert str(e.value).startswith(message)


def test_replay_has_no_model_options_to_check():
    """A replay's arguments lack --rank-nice: nothing to check, the defaults pass."""
    args = _args("replay")
    assert not hasattr(args, "rank_nice") and args.no_check and args.model == "none"
    assert check_arguments(args) == [512]
    assert check_arguments(_args("run")) == [512]


def _req(rid, n, out, conv=None):
    return TraceRequest(request_id=rid, prompt_token_ids=[1] * n, max_tokens=out,
                        conversation=conv)


def test_longest_request_counts_the_conversation_history():
    """A turn is sent with every earlier turn's prompt and output; standalone requests
    are their own prompt plus output."""
    workload = [_req("a0", 10, 5, "a"), _req("x", 20, 2), _req("a1", 4, 3, "a"),
                _req("b0", 20, 1, "b"), _req("a2", 1, 1, "a")]
    # a2: 10 + 5 + 4 + 3 (history) + 1 + 1
    assert longest_request(workload) == (24, "a2")
    assert longest_request([_req("x", 30, 2)]) == (32, "x")


def test_max_model_len_too_small_for_the_workload_is_refused():
    workload = [_req("a0", 10, 5, "a"), _req("a1", 4, 3, "a")]
    check_fits(workload, 22, 16, [512], 4, ["shared"], 2)  # exactly enough
    with pytest.raises(UsageError) as e:
        check_fits(workload, 21, 16, [512], 4, ["shared"], 2)
    assert str(e.value) == (
        "--max-model-len 21: too small for this workload, whose longest request (a1: its "
        "prompt as sent, with its conversation's history, plus the tokens it generates) is "
        "22 tokens; use --max-model-len 22 or more")


def test_a_pool_too_small_for_one_request_names_blocks():
    """Every pool of every run holds one request of --max-model-len in each group, plus
    the null block; private pools (1/N the blocks) are checked first."""
    workload = [_req("a", 10, 5)]
    check_fits(workload, 64, 16, [9], 1, ["shared"], 2)  # 4 x 2 + 1
    with pytest.raises(UsageError, match=r"^--blocks 8: one pool of 8 blocks cannot hold one "
                       r"request of --max-model-len 64 \(9 blocks: 4 per KV-cache group x 2 "
                       r"groups \+ the null block\); raise --blocks to 9 or"):
        check_fits(workload, 64, 16, [8], 1, ["shared"], 2)
    with pytest.raises(UsageError, match=r"^--blocks 20: 4 private pools of 5 blocks .* "
                       r"raise --blocks to 36 or"):
        check_fits(workload, 64, 16, [1024, 20], 4, ["shared", "private"], 2)


# ---------------------------------------------------------------------------- the words

def _figures(pool="shared", routing="round-robin", saved=300, **kw) -> dict:
    f = {"pool": pool, "routing": routing, "schedulers": 4, "num_blocks": 512,
         "blocks_per_pool": 512 if pool == "shared" else 128, "kv_cache_groups": 2,
         "blocks_per_group": 256 if pool == "shared" else 64, "block_size": 16,
         "model_free": False, "requests": 10, "requests_total": 10, "requests_failed": 0,
         "prompt_tokens": 1000, "prefill_tokens_saved": saved,
         "prefix_hit_rate": saved / 1000, "evictions": 7, "token_mismatches": 0,
         "tokens_checked": 50, "wall_s": 2.0, "pool_valid": True}
    f.update(kw)
    return f


def test_comparison_says_the_gain_against_the_best_baseline_router():
    """The table's lines (hit rate, saved, TTFT p50/p99, queued p99, imbalance), then the
    shared pool against the baseline router with the lowest TTFT p99 in hit rate and TTFT
    p99, a loss said as a loss; the token check and the pools' validity."""
    lat = {"ttft_p50_s": 0.004, "ttft_p99_s": 0.020, "queued_p99_s": 0.003,
           "requests_per_scheduler": [3, 3, 2, 2], "imbalance": 1.5}
    runs = [_figures(routing="least-loaded", **lat),
            _figures("private", "sglang-cache-aware", saved=280,
                     **dict(lat, ttft_p99_s=0.050)),
            _figures("private", "llm-d-scorer", saved=250, **dict(lat, ttft_p99_s=0.040)),
            _figures("private", saved=100, **dict(lat, ttft_p99_s=0.010))]
    text = report.comparison_text(runs)
    lines = text.splitlines()
    assert lines[0] == "same workload, 512 blocks in all (256 per KV-cache group), 4 schedulers:"
    assert lines[2].split() == ["shared,", "least-loaded", "30.0%", "300", "of", "1,000",
                                "4", "/", "20", "3", "1.50x", "7", "0", "2.0"]
    # round-robin's p99 is lower still, but it is no baseline: llm-d's is the best of them
    gain = " ".join(" ".join(lines[6:-2]).split())
    assert gain == ("shared pool (least-loaded) against the best baseline router, private "
                    "pools with llm-d-scorer (the lowest TTFT p99 of the baselines "
                    "sglang-cache-aware and llm-d-scorer; round-robin is no baseline): "
                    "hit rate 30.0% against 25.0% (+5.0 points, a gain); TTFT p99 20 ms "
                    "against 40 ms (2.00x lower: a gain)")
    assert lines[-2] == ("  generated tokens checked against the model's no-cache reference: "
                         "200, 0 different")
    assert lines[-1].startswith("  every request finished; every pool valid after its run")
    loss = report.gain_text(_figures(routing="least-loaded", saved=200, ttft_p99_s=0.03),
                            runs[2])
    assert "(-5.0 points, a loss)" in loss and "(0.75x higher: a loss)" not in loss
    assert "TTFT p99 30 ms against 40 ms (1.33x lower: a gain)" in loss
    worse = report.gain_text(_figures(routing="least-loaded", ttft_p99_s=0.06), runs[2])
    assert "TTFT p99 60 ms against 40 ms (1.50x higher: a loss)" in worse
    assert "(the only baseline that ran)" in worse
    bad = report.comparison_text([_figures(pool_valid=False, requests=9)])
    assert bad.splitlines()[-1].startswith("  every request did NOT finish; every pool NOT "
                                           "valid")


def test_comparison_names_the_rule_and_calls_a_close_ttft_a_tie():
    """The best baseline is the lower TTFT p99 of SGLang's and llm-d's routers, said so, even
    when round-robin's is lower; an equal TTFT p99 (or one within the noise band, stated) is
    a tie, not a loss; outside the band it is a gain or a loss."""
    lat = {"ttft_p50_s": 0.004, "requests_per_scheduler": [3, 3, 2, 2], "imbalance": 1.5}
    runs = [_figures(routing="prefix-aware", **dict(lat, ttft_p99_s=0.106)),
            _figures("private", "sglang-cache-aware", **dict(lat, ttft_p99_s=0.120)),
            _figures("private", "llm-d-scorer", **dict(lat, ttft_p99_s=0.106)),
            _figures("private", **dict(lat, ttft_p99_s=0.090))]
    gain = " ".join(report.comparison_text(runs).split())
    assert ("against the best baseline router, private pools with llm-d-scorer (the lowest "
            "TTFT p99 of the baselines sglang-cache-aware and llm-d-scorer; round-robin is no "
            "baseline)") in gain
    assert ("TTFT p99 106 ms against 106 ms (equal, within the 10% taken as noise: a tie)"
            ) in gain and "a loss" not in gain
    assert report.ttft_text(0.1105, 0.106) == "1.04x higher, within the 10% taken as noise: a tie"
    assert report.ttft_text(0.100, 0.106) == "1.06x lower, within the 10% taken as noise: a tie"
    assert report.ttft_text(0.117, 0.106) == "1.10x higher: a loss"
    assert report.ttft_text(0.090, 0.106) == "1.18x lower: a gain"
    assert report.ttft_text(0.0, 0.106) == "not measured"


def test_run_line_and_intro():
    f = _figures("private", requests=9, requests_failed=1)
    assert report.run_line(f, 2, 3) == (
        "  run 2 of 3: 4 private pools of 128 blocks, round-robin: 9/10 requests, 1 not "
        "served, hit rate 30.0%, 2.0 s")
    intro = report.intro_text(_figures(model_free=True, trace={"summary": "t.jsonl (x)"}),
                              [("shared", "round-robin"), ("private", "prefix-aware")])
    assert intro == ("shmkv replay: the trace t.jsonl (x); 4 schedulers, no model (the "
                     "KV-cache layer alone); 512 blocks\nin all (256 per KV-cache group); "
                     "2 runs:")
    assert all(len(line) <= 100 for line in intro.splitlines())


def test_replay_report_explains_its_lock_wait_and_titles_say_replay():
    shared, private = _figures(model_free=True), _figures("private", model_free=True)
    assert report.lock_wait_text(shared).startswith("a replay has no model step")
    assert report.lock_wait_text(private).startswith("each private pool has a lock")
    assert report.lock_wait_text(_figures()) == ""
    assert report.timeline_title([shared]).startswith("shmkv replay: shared pool")
    assert report.timeline_title([shared, private]).startswith("shmkv replay: shared and "
                                                               "private pools")
    assert report.timeline_title([_figures()]).startswith("shmkv run: shared pool")
    assert report.groups_text(private) == ("16 tokens each; 2 KV-cache groups, so each "
                                           "prompt block takes 2: 64 per group in each "
                                           "private pool")


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_plot_file_mode_is_that_of_a_json_file_beside_it(tmp_path, umask, mode):
    """A plot gets 0666 less the umask, as ``open(path, "w")`` gives the JSON."""
    pytest.importorskip("matplotlib")
    from shmkv import plot

    old = os.umask(umask)
    try:
        plot.line_chart(tmp_path / "p.png", title="t", x_label="x", y_label="y",
                        series={"a": ([1, 2], [1, math.e])})
        (tmp_path / "p.json").write_text("{}")
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "p.png").st_mode & 0o777 == mode
    assert os.stat(tmp_path / "p.json").st_mode & 0o777 == mode


def test_progress_bar_says_which_run(capsys):
    """On a terminal the progress bar of a sweep's or a comparison's run starts with
    "run k of n"."""
    from shmkv.serve.runner import _Progress

    bar = _Progress(10, True, "run 3 of 9")
    bar.update(5, 0.5, 0.25, 1.0, force=True)
    bar.finish()
    err = capsys.readouterr().err
    assert err.startswith("\r  run 3 of 9 [") and "5/10 requests" in err
    _Progress(10, False, "run 1 of 1").update(1, 0.0, 0.0, 0.1, force=True)
    assert capsys.readouterr().err == ""


def test_run_summary_shows_three_notes_and_problems_and_counts_the_rest():
    f = _figures(notes=["n1"], problems=[f"p{k}" for k in range(5)])
    assert report.run_summary(f, 1, 1).splitlines()[1:] == [
        "    note: n1", "    problem: p0", "    problem: p1", "    problem: p2",
        "    ... and 2 more problem(s) (--verbose or --json: all)"]
