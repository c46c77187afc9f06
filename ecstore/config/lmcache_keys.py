"""LMCache's own keys: shared config files may hold them; ecstore ignores them quietly."""

from __future__ import annotations

# Keys LMCache defines for its KV cache (current names, aliases and legacy
# names). They may appear in the shared YAML, bare or ec_-prefixed (LMCache's
# own EC engine reads ec_<key>), and are ignored without a warning.
LMCACHE_KEYS: frozenset[str] = frozenset("""
    chunk_size local_cpu max_local_cpu_size local_cpu_use_hugepages reserve_local_cpu_size
    local_disk local_disk_path_sharding max_local_disk_size max_local_cache_size local_device
    remote_url remote_serde remote_config_url app_id use_layerwise save_decode_cache
    save_unfull_chunk pre_caching_hash_algorithm pipelined_backend backend
    enable_blending blend_recompute_ratio blend_recompute_ratios blend_thresholds
    blend_check_layers blend_min_tokens blend_special_str blend_separator
    blend_add_special_in_precomp retrieve_locations store_location
    enable_p2p p2p_host p2p_init_ports p2p_lookup_ports lookup_url distributed_url
    mp_host mp_port enable_controller controller_url controller_pull_url controller_reply_url
    lmcache_instance_id lmcache_worker_port lmcache_worker_ports lmcache_worker_ids
    lmcache_worker_heartbeat_delay_time lmcache_worker_heartbeat_time
    enable_pd enable_xpyd pd_role pd_buffer_size pd_buffer_device pd_peer_host
    pd_peer_init_port pd_peer_alloc_port pd_peer_query_port pd_proxy_host pd_proxy_port
    transfer_channel enable_nixl nixl_role nixl_backends nixl_buffer_size nixl_buffer_device
    nixl_receiver_host nixl_receiver_port nixl_enable_gc nixl_peer_host nixl_peer_port
    nixl_peer_init_port nixl_peer_alloc_port nixl_proxy_host nixl_proxy_port
    gds_path gds_path_sharding gds_buffer_size gds_backend use_gds cufile_buffer_size weka_path
    maru_path maru_pool_size audit_actual_remote_url extra_config blocking_timeout_secs
    external_lookup_client py_enable_gc cache_policy cost_aware_half_life_seconds
    cost_aware_ewma_alpha numa_mode enable_async_loading internal_api_server_enabled
    internal_api_server_host internal_api_server_port_start
    internal_api_server_include_index_list internal_api_server_socket_path_prefix
    priority_limit plugin_locations runtime_plugin_locations external_backends storage_plugins
    remote_storage_plugins lookup_timeout_ms min_retrieve_tokens hit_miss_ratio
    lookup_server_worker_ids enable_scheduler_bypass_lookup script_allowed_imports
    enable_lazy_memory_allocator lazy_memory_initial_ratio lazy_memory_expand_trigger_ratio
    lazy_memory_step_ratio lazy_memory_safe_size enable_chunk_statistics enable_kv_events
    use_gpu_connector_v3 pin_timeout_sec pin_check_interval_sec enable_hidden_state_cache
    max_hidden_state_cpu_size hidden_state_layers hidden_states_retrieve_mode
""".split())

# Whole families of LMCache keys (new ones appear with each release).
LMCACHE_KEY_PREFIXES: tuple[str, ...] = (
    "pd_", "nixl_", "p2p_", "blend_", "gds_", "lmcache_worker_", "internal_api_server_",
    "lazy_memory_", "chunk_statistics_", "controller_", "lookup_",
)


def is_lmcache_key(key: str) -> bool:
    """Is ``key`` (without an ``ec_`` prefix) one of LMCache's own settings?"""
    return key in LMCACHE_KEYS or key.startswith(LMCACHE_KEY_PREFIXES)
