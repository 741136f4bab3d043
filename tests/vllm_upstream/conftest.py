# vLLM's unpacked tests run in the adapter's own session (test_upstream.py), never in this one.
collect_ignore = ["_upstream"]
