"""The one list of vLLM upstream tests (``tests/v1/core/``) that the adapter does not run as
they are, each with a one-line reason: those of 0.33.0 (``DESELECTED``, ``KNOWN_GAPS``) and
what each later release adds (``BY_RELEASE``); the release is ``$SHMKV_UPSTREAM_RELEASE``,
which ``run.py`` sets to the installed vLLM's.

``DESELECTED``: not run against shmkv. Two kinds of reason:

- ``private:`` the test reads or writes vLLM-private structure (the free list's sentinel nodes,
  the prefix index's private dict, the private event list, standalone ``KVCacheBlock`` objects
  that never came from the pool). Each names its public-call twin in
  ``tests/vllm_upstream/test_twins.py``, which runs on vLLM and on shmkv and must agree.
- ``env:`` the test fails against vLLM itself here (it builds vLLM's ``ModelConfig``, which asks
  the Hugging Face hub, offline in CI; or a ``VllmConfig`` that needs a device platform).

``KNOWN_GAPS``: run as strict xfails (so a fix that makes one pass fails the run until it is
taken off): what shmkv still lacks ("by design:" where shmkv refuses with a clearer error on
purpose, "not mirrored:" for a detail of vLLM's internals shmkv leaves out). Keys are node ids relative to
``tests/vllm_upstream/_upstream``; a key without ``[params]`` covers every parametrization.
"""

import os

P = "tests/v1/core/"

DESELECTED: dict[str, str] = {
    P + "prefix_cache/test_partial_prefix_cache_primitives.py::test_cache_partial_block_duplicate_checks_all_blocks_for_hash":
        "private: reads the pool's private reverse map (cached_block_hashes_by_block); twin: test_partial_entries_gone_after_evict_and_reset",
    P + "prefix_cache/test_partial_prefix_cache_primitives.py::test_evict_cached_block_removes_full_hash_and_partial_entry":
        "private: reads the pool's private reverse map (cached_block_hashes_by_block); twin: test_partial_entries_gone_after_evict_and_reset",
    P + "prefix_cache/test_partial_prefix_cache_primitives.py::test_reset_prefix_cache_clears_partial_entry_metadata":
        "private: reads the pool's private reverse map (cached_block_hashes_by_block); twin: test_partial_entries_gone_after_evict_and_reset",
    P + "test_prefix_caching.py::test_block_stored_event_group_idx_out_of_bounds":
        "private: appends to the pool's private event list (block_pool.kv_event_queue) and patches vLLM's module logger; twin: test_kv_cache_events_drained_by_take_events",
    P + "test_prefix_caching.py::test_cache_blocks":
        "private: caches standalone KVCacheBlock(i) objects never taken from the pool (block 0 is the pool's null block); twin: test_cache_full_blocks_counts_keys",
    P + "test_prefix_caching.py::test_cache_blocks_multi_group":
        "private: caches standalone KVCacheBlock(i) objects never taken from the pool (block 0 is the pool's null block); twin: test_cache_full_blocks_counts_keys",
    P + "test_prefix_caching.py::test_different_block_size":
        "private: pops entries from the index by key and block id (cached_block_hash_to_block.pop(key, id)); twin: test_hits_after_evicting_chosen_blocks",
    P + "test_prefix_caching.py::test_eagle_with_sliding_window":
        "private: pops entries from the index's private dict (cached_block_hash_to_block._cache); twin: test_hits_after_evicting_chosen_blocks",
    P + "test_prefix_caching.py::test_kv_cache_events":
        "private: reads the pool's private event list (block_pool.kv_event_queue); twin: test_kv_cache_events_drained_by_take_events",
    P + "test_prefix_caching.py::test_maybe_evict_cached_block":
        "private: writes hashes into blocks and the index directly (KVCacheBlock.set_block_hash, ._cache); twin: test_hits_after_evicting_chosen_blocks",
    P + "test_prefix_caching.py::test_prefill_hybrid_model":
        "private: pops entries from the index's private dict (cached_block_hash_to_block._cache); twin: test_hits_after_evicting_chosen_blocks",
    P + "test_prefix_caching.py::test_prefill_hybrid_model_eagle":
        "private: pops entries from the index's private dict (cached_block_hash_to_block._cache); twin: test_hits_after_evicting_chosen_blocks",
    P + "test_single_type_kv_cache_manager.py::test_chunked_local_attention_possible_cached_prefix":
        "private: reads the index's private dict (cached_block_hash_to_block._cache); twin: test_hits_after_evicting_chosen_blocks",
    P + "test_single_type_kv_cache_manager.py::test_chunked_local_attention_remove_skipped_blocks":
        "private: puts standalone KVCacheBlock(id) objects into manager.req_to_blocks; twin: test_remove_skipped_blocks_frees_the_same_blocks",
    P + "test_single_type_kv_cache_manager.py::test_rswa_remove_skipped_blocks_gap_range":
        "private: puts standalone KVCacheBlock(id) objects into manager.req_to_blocks; twin: test_remove_skipped_blocks_frees_the_same_blocks",
    P + "test_single_type_kv_cache_manager.py::test_sliding_window_cache_hit_with_finer_hash_alignment":
        "private: inserts standalone blocks into the index (cached_block_hash_to_block.insert(key, block)); twin: test_hits_after_evicting_chosen_blocks",
    P + "test_single_type_kv_cache_manager.py::test_sliding_window_possible_cached_prefix":
        "private: reads the index's private dict (cached_block_hash_to_block._cache); twin: test_hits_after_evicting_chosen_blocks",
    P + "test_single_type_kv_cache_manager.py::test_sliding_window_remove_skipped_blocks":
        "private: puts standalone KVCacheBlock(id) objects into manager.req_to_blocks; twin: test_remove_skipped_blocks_frees_the_same_blocks",
    P + "test_kv_cache_utils.py::test_dcp_replicated_kpool_tail_keeps_block_interior_layout":
        "env: fails against vLLM itself here (ModelConfig asks the Hugging Face hub)",
    P + "test_kv_cache_utils.py::test_dcp_target_allocates_replicated_draft_independently":
        "env: fails against vLLM itself here (ModelConfig asks the Hugging Face hub)",
    P + "test_kv_cache_utils.py::test_full_attention_merge_preserves_replicated_cache_geometry":
        "env: fails against vLLM itself here (ModelConfig asks the Hugging Face hub)",
    P + "test_kv_cache_utils.py::test_get_max_concurrency_for_kv_cache_config":
        "env: fails against vLLM itself here (ModelConfig asks the Hugging Face hub)",
    P + "test_kv_cache_utils.py::test_hisparse_derived_specs_do_not_affect_kv_cache_layout":
        "env: fails against vLLM itself here (ModelConfig asks the Hugging Face hub)",
    P + "test_kv_cache_utils.py::test_hma_not_disabled_when_kv_events_enabled":
        "env: fails against vLLM itself here (ModelConfig asks the Hugging Face hub)",
    P + "test_kv_cache_utils.py::test_uniform_type_spec_block_table_width_matches_layer_spec":
        "env: fails against vLLM itself here (ModelConfig asks the Hugging Face hub)",
    P + "test_prefix_caching.py::test_hisparse_admitted_async_loads_can_finish_with_nothing_running":
        "env: fails against vLLM itself here (VllmConfig cannot infer a device type on CPU)",
    P + "test_prefix_caching.py::test_hisparse_async_admission_requires_full_prompt_host_pages":
        "env: fails against vLLM itself here (VllmConfig cannot infer a device type on CPU)",
    P + "test_prefix_caching.py::test_nixl_hisparse_full_block_import_keeps_a_writable_tail":
        "env: fails against vLLM itself here (ModelConfig asks the Hugging Face hub)",
}

KNOWN_GAPS: dict[str, str] = {
    P + "prefix_cache/test_partial_prefix_cache_primitives.py::test_cache_partial_block_requires_hash_boundary":
        "by design: vLLM asserts (AssertionError), shmkv raises UsageError (docs/errors.md)",
}


_ENV_DEVICE = "env: fails against vLLM itself here (VllmConfig cannot infer a device type on CPU)"
_ENV_HUB = "env: fails against vLLM itself here (ModelConfig asks the Hugging Face hub)"

# What each release after 0.33.0 adds to the two tables (its tests that are new or changed).
BY_RELEASE: dict[str, tuple[dict[str, str], dict[str, str]]] = {
    "0.34.0": ({
        P + "test_prefix_caching.py::test_reset_prefix_cache":
            "private: reads the index's private dict (cached_block_hash_to_block._cache); twin: test_partial_entries_gone_after_evict_and_reset",
        P + "test_kv_cache_utils.py::test_generate_scheduler_kv_cache_config_keeps_zeroing":
            _ENV_HUB,
        P + "test_kv_cache_utils.py::test_num_hash_lookahead_tokens": _ENV_DEVICE,
        P + "test_kv_cache_utils.py::test_pipeline_stages_resolve_a_layout_every_stage_supports":
            _ENV_HUB,
        P + "test_prefix_caching.py::test_hisparse_async_admission_fits_beside_inflight_import":
            _ENV_DEVICE,
        P + "test_prefix_caching.py::test_hisparse_import_reservation_does_not_gate_local_admissions":
            _ENV_DEVICE,
        P + "test_prefix_caching.py::test_hisparse_import_reservation_released": _ENV_DEVICE,
    }, {
        P + "test_prefix_caching.py::test_hisparse_teardown_with_live_request_frees_pools":
            "not mirrored: vLLM hides each request's block list from the cyclic GC (a collection-time saving); shmkv's lists stay tracked",
    }),
}

RELEASE = os.environ.get("SHMKV_UPSTREAM_RELEASE", "0.33.0")
if RELEASE in BY_RELEASE:
    DESELECTED = {**DESELECTED, **BY_RELEASE[RELEASE][0]}
    KNOWN_GAPS = {**KNOWN_GAPS, **BY_RELEASE[RELEASE][1]}
