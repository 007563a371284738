"""EngineConfig: defaults from config.toml, flat keyword overrides, errors that name the key."""

from __future__ import annotations

import tomllib
from dataclasses import fields
from pathlib import Path

import pytest

from engine.config import (
    SECTIONS, CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, all_keys, parse_sweep, parse_value, section_of,
)

CONFIG = Path(__file__).resolve().parent.parent / "config.toml"


def test_defaults_load_from_config_toml():
    config = EngineConfig.load(CONFIG)
    assert config.model.model == "smollm2-135m"
    assert config.model.dtype == "float32"
    assert config.scheduler.policy == "chunked"
    assert config.scheduler.max_num_seqs == 64
    assert config.cache.block_size == 16
    assert config.cache.enable_prefix_caching is True
    assert config.server.port == 8000
    # The shipped file and the dataclass defaults agree, and the file lists every key.
    assert config == EngineConfig() == EngineConfig.load(None)
    raw = tomllib.loads(CONFIG.read_text())
    assert set(raw) == set(SECTIONS)
    for name, section_cls in SECTIONS.items():
        assert set(raw[name]) == {f.name for f in fields(section_cls)}, name


def test_keys_are_unique_across_sections():
    names = [f.name for section_cls in SECTIONS.values() for f in fields(section_cls)]
    assert len(names) == len(set(names))
    assert set(all_keys()) == set(names)
    assert section_of("policy") == "scheduler" and section_of("port") == "server"


def test_keyword_overrides():
    config = EngineConfig.load(CONFIG, policy="static", port=9000, block_size=32, model="tiny-random")
    assert config.scheduler.policy == "static"
    assert config.server.port == 9000
    assert config.cache.block_size == 32
    assert config.model.model == "tiny-random"
    # untouched keys keep their file values
    assert config.scheduler.max_num_seqs == 64 and config.cache.num_blocks == 1536
    again = config.with_overrides(policy="continuous")
    assert again.scheduler.policy == "continuous" and config.scheduler.policy == "static"  # frozen copy


@pytest.mark.parametrize(
    "overrides,key",
    [
        ({"policy": "fast"}, "policy"),
        ({"port": "8000"}, "port"),
        ({"port": True}, "port"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"linear_backend": "blas"}, "linear_backend"),
        ({"weight_format": "q4"}, "weight_format"),
        ({"weight_format": "gguf", "linear_backend": "int8"}, "weight_format"),
        ({"weight_format": "gguf-q8", "linear_backend": "int8"}, "weight_format"),
        ({"no_such_key": 1}, "no_such_key"),
        ({"router": "random"}, "router"),
        ({"replicas": -1}, "replicas"),
        ({"replica_cpus": 0.0}, "replica_cpus"),
        ({"balance_rel_threshold": 0.5}, "balance_rel_threshold"),
        ({"replica_cpus": "1"}, "replica_cpus"),
        ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype"),
        ({"kv_cache_dtype": "float32"}, "kv_cache_dtype"),
        ({"seed": -1}, "'seed' must be in"),
        ({"seed": 2**64}, "'seed' must be in"),
        ({"priority_aging_s": float("inf")}, "'priority_aging_s' must be a finite number"),
        ({"replicas": 1, "balance_rel_threshold": float("inf")}, "'balance_rel_threshold' must be a finite"),
        ({"replicas": 1, "replica_cpus": float("nan")}, "'replica_cpus' must be a finite"),
        ({"protect_metrics": True}, "'protect_metrics' needs an api_key"),
        ({"protect_health": True}, "'protect_health' needs an api_key"),
    ],
)
def test_bad_keyword_override_names_the_key(overrides, key):
    with pytest.raises(ValueError, match=key):
        EngineConfig.load(CONFIG, **overrides)


def write_config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "text,names",
    [
        ('[scheduler]\npolicy = "fast"\n', ["policy"]),
        ('[server]\nport = "x"\n', ["port"]),
        ("[server]\nport = 70000\n", ["port"]),
        ("[server]\nport = true\n", ["port"]),
        ("[scheduler]\nmax_num_seqs = 0\n", ["max_num_seqs"]),
        ("[scheduler]\nmax_num_seqs = 1.5\n", ["max_num_seqs"]),
        ('[model]\ndtype = "int3"\n', ["dtype"]),
        ("[cache]\nenable_prefix_caching = 1\n", ["enable_prefix_caching"]),
        ("[cache]\nblock_sise = 16\n", ["block_sise", "cache"]),
        ("[schedular]\npolicy = \"static\"\n", ["schedular"]),
        ('model = "tiny-random"\n', ["[model] must be a table", "str 'tiny-random'"]),
        ("[[scheduler]]\nmax_num_seqs = 4\n", ["[scheduler] must be a table", "list"]),
        ("scheduler = 5\n", ["[scheduler] must be a table", "int 5"]),
    ],
    ids=[
        "policy-fast",
        "port-string",
        "port-range",
        "port-bool",
        "max_num_seqs-zero",
        "max_num_seqs-float",
        "dtype",
        "bool-as-int",
        "unknown-key",
        "unknown-section",
        "flat-key-at-the-top",
        "array-of-tables",
        "section-as-a-number",
    ],
)
def test_bad_values_in_file_name_the_key(tmp_path, text, names):
    with pytest.raises(ValueError) as err:
        EngineConfig.load(write_config(tmp_path, text))
    for name in names:
        assert name in str(err.value)


def test_bad_toml_is_a_value_error_naming_the_file(tmp_path):
    path = write_config(tmp_path, "[scheduler\npolicy = chunked\n")
    with pytest.raises(ValueError) as err:
        EngineConfig.load(path)
    assert str(path) in str(err.value) and "TOML" in str(err.value)


def test_partial_file_keeps_defaults(tmp_path):
    config = EngineConfig.load(write_config(tmp_path, '[scheduler]\npolicy = "continuous"\n'))
    assert config.scheduler.policy == "continuous"
    assert config.scheduler.max_num_seqs == 64 and config.server.port == 8000


def test_cluster_section_and_int_for_float():
    config = EngineConfig.load(None, replicas=2, router="round-robin")
    assert config.cluster.replicas == 2 and config.cluster.router == "round-robin"
    assert section_of("replica_cpus") == "cluster"


@pytest.mark.parametrize("text, key", [
    ('router = "round-robin"', "router"), ("replica_cpus = 2", "replica_cpus"), ('ray_address = "auto"', "ray_address"),
])
def test_cluster_keys_without_replicas_are_refused_naming_the_key(tmp_path, text, key):
    with pytest.raises(ValueError, match=f"'{key}' has no effect with replicas = 0"):
        EngineConfig.load(write_config(tmp_path, f"[cluster]\n{text}\n"))
    assert EngineConfig.load(write_config(tmp_path, f"[cluster]\nreplicas = 1\n{text}\n")).cluster.replicas == 1


def test_an_integer_is_accepted_for_a_float_key_but_a_bool_is_not(tmp_path):
    config = EngineConfig.load(write_config(tmp_path, "[cluster]\nreplicas = 2\nreplica_cpus = 2\nbalance_rel_threshold = 2\n"))
    assert config.cluster.replica_cpus == 2.0 and isinstance(config.cluster.replica_cpus, float)
    with pytest.raises(ValueError, match="replica_gpus"):
        EngineConfig.load(write_config(tmp_path, "[cluster]\nreplica_gpus = true\n"))


def test_parse_sweep():
    assert parse_sweep("max_step_ms=200,400") == ("max_step_ms", ["200", "400"])
    with pytest.raises(ValueError, match="KEY=V1,V2"):
        parse_sweep("max_step_ms")
    with pytest.raises(ValueError, match="'200' given more than once"):
        parse_sweep("max_step_ms=200,400,200")


def test_parse_value_refuses_a_bool_it_cannot_read():
    """`--set enable_prefix_caching=on` used to turn the cache off: any unknown spelling read as false."""
    for text, value in [("on", True), ("YES", True), ("1", True), ("true", True), ("off", False), ("no", False),
                        ("0", False), ("False", False)]:
        assert parse_value("enable_prefix_caching", text) is value, text
    for text in ("ture", "y", "maybe", ""):
        with pytest.raises(ValueError, match=f"'enable_prefix_caching': bad value {text!r} .*on/off"):
            parse_value("enable_prefix_caching", text)
    assert parse_value("num_blocks", "64") == 64


def test_kv_dtype_for():
    """auto: the model's dtype; otherwise the kv_cache_dtype asked for."""
    assert EngineConfig.load(CONFIG).cache.kv_dtype_for("bfloat16") == "bfloat16"
    assert EngineConfig.load(CONFIG, kv_cache_dtype="float16").cache.kv_dtype_for("float32") == "float16"


@pytest.mark.parametrize("build, message", [
    (lambda: EngineConfig(cache=CacheConfig(num_blocks=2.5)), "'num_blocks': expected int, got float"),
    (lambda: EngineConfig(model=ModelConfig(num_threads="1")), "'num_threads': expected int, got str"),
    (lambda: EngineConfig(cache=CacheConfig(block_size=True)), "'block_size': expected int, got bool"),
    (lambda: EngineConfig(scheduler=SchedulerConfig(calibrate_step_cost="no")), "'calibrate_step_cost': expected bool"),
    (lambda: EngineConfig(scheduler=SchedulerConfig(priority_aging_s=float("inf"))), "'priority_aging_s' must be finite"),
    (lambda: EngineConfig(model="tiny-random"), "section 'model' must be a ModelConfig, got str"),
])
def test_a_config_built_in_code_is_checked_as_a_loaded_one(build, message):
    """Sections built in code used to skip the type checks; start() then failed late, naming no key."""
    with pytest.raises(ValueError, match=message.replace("finite", "a finite number")):
        build()


def test_a_config_built_in_code_takes_an_int_for_a_float():
    assert EngineConfig(scheduler=SchedulerConfig(priority_aging_s=3)).scheduler.priority_aging_s == 3


def test_ray_num_cpus_with_a_ray_address_is_refused(tmp_path):
    """It sizes a local Ray only: with ray_address it was accepted and never read."""
    with pytest.raises(ValueError, match="ray_num_cpus"):
        EngineConfig.load(None, replicas=2, ray_address="auto", ray_num_cpus=8)
    assert EngineConfig.load(None, replicas=2, ray_num_cpus=8).cluster.ray_num_cpus == 8


@pytest.mark.parametrize("key,value", [("prefix_min_share", 0.3), ("balance_abs_threshold", 2),
                                       ("balance_rel_threshold", 2.0), ("max_prefix_entries", 10)])
def test_prefix_router_keys_under_another_router_are_unread(key, value):
    for router in ("round-robin", "least-loaded"):
        assert EngineConfig.load(None, replicas=2, router=router, **{key: value}).cluster.unread_router_keys() == [key]
    assert not EngineConfig.load(None, replicas=2, **{key: value}).cluster.unread_router_keys()  # router "prefix"
