"""The one typed configuration: frozen dataclasses loaded from config.toml.

Keys are unique across sections, so a flat keyword override (`policy="chunked"`) or a CLI
flag (`--policy chunked`) finds its section without the caller naming it.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, get_type_hints
from urllib.parse import urlsplit

from engine.model.wheel_model import WHEEL_MODELS
from engine.policies import POLICIES as _REGISTRY  # every policy module registers itself

DEFAULT_CONFIG = "config.toml"

POLICIES = tuple(_REGISTRY)
BACKENDS = ("auto", "torch", "cpu", "triton")
DTYPES = ("float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "float16", "bfloat16")  # auto = the model's dtype
LINEAR_BACKENDS = ("auto", "onednn", "torch", "int8")
ROUTERS = ("prefix", "round-robin", "least-loaded")
# Cluster keys only the prefix-affinity router reads.
PREFIX_ROUTER_KEYS = ("balance_abs_threshold", "balance_rel_threshold", "max_prefix_entries", "prefix_min_share")
WEIGHT_FORMATS = ("auto", "dequantized", "gguf", "gguf-q8")


BUILTIN_MODEL_NAMES = {**{m.name: m.served_name for m in WHEEL_MODELS.values()}, "tiny-random": "tiny-random"}


def model_display_name(spec: str) -> str:
    """The name a model is served under by default: the built-in's, else the checkout
    directory's or the .gguf file's (what the loader calls it too)."""
    if spec in BUILTIN_MODEL_NAMES:
        return BUILTIN_MODEL_NAMES[spec]
    path = Path(spec).expanduser()
    return path.stem if path.suffix == ".gguf" else path.name


@dataclass(frozen=True)
class ModelConfig:
    model: str = "smollm2-135m"
    cache_dir: str = ""
    dtype: str = "float32"
    attention_backend: str = "auto"
    linear_backend: str = "auto"
    weight_format: str = "auto"
    device: str = "auto"
    num_threads: int = 0
    seed: int = 0  # seeds the sampling of requests that bring no seed of their own

    def validate(self) -> None:
        _require(bool(self.model), "model", "must not be empty")
        _require(self.dtype in DTYPES, "dtype", f"must be one of {DTYPES}")
        _require(self.attention_backend in BACKENDS, "attention_backend", f"must be one of {BACKENDS}")
        _require(self.linear_backend in LINEAR_BACKENDS, "linear_backend", f"must be one of {LINEAR_BACKENDS}")
        _require(self.weight_format in WEIGHT_FORMATS, "weight_format", f"must be one of {WEIGHT_FORMATS}")
        _require(not (self.weight_format in ("gguf", "gguf-q8") and self.linear_backend == "int8"), "weight_format",
                 f"{self.weight_format!r} runs the GGUF blocks as stored; it cannot be combined with linear_backend 'int8'")
        _require(self.device in ("auto", "cpu", "cuda"), "device", "must be auto, cpu or cuda")
        _require(self.num_threads >= 0, "num_threads", "must be >= 0")
        _require(0 <= self.seed < 2**63, "seed", "must be in [0, 2^63), as a request's seed")

    def resolved_cache_dir(self) -> Path:
        if self.cache_dir:
            return Path(self.cache_dir).expanduser()
        # The only place the environment is read for configuration (engine/cpu.py reads
        # STEPWISE_CPU_FEATURES, which narrows the CPU's features for tests and benchmarks).
        xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        return Path(xdg) / "stepwise"


@dataclass(frozen=True)
class SchedulerConfig:
    policy: str = "chunked"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    chunk_size: int = 256
    batch_timeout_ms: int = 50
    max_waiting: int = 1024
    priority_aging_s: float = 0.0
    max_step_ms: int = 1000
    min_chunk: int = 32
    calibrate_step_cost: bool = True

    def validate(self) -> None:
        _require(self.policy in POLICIES, "policy", f"must be one of {POLICIES}")
        _require(self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1")
        _require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be >= 1")
        _require(self.chunk_size >= 1, "chunk_size", "must be >= 1")
        _require(self.batch_timeout_ms >= 0, "batch_timeout_ms", "must be >= 0")
        _require(self.max_waiting >= 1, "max_waiting", "must be >= 1")
        _require(self.priority_aging_s >= 0, "priority_aging_s", "must be >= 0 (0 = strict priority)")
        _require(self.max_step_ms >= 0, "max_step_ms", "must be >= 0 (0 = token budget only)")
        _require(self.min_chunk >= 1, "min_chunk", "must be >= 1")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int = 1536
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"

    def validate(self) -> None:
        _require(self.block_size >= 1, "block_size", "must be >= 1")
        _require(self.num_blocks >= 1, "num_blocks", "must be >= 1")
        _require(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype", f"must be one of {KV_CACHE_DTYPES}")

    def kv_dtype_for(self, model_dtype: str) -> str:
        """The KV cache's element type (a DTYPES name) under a model of `model_dtype`."""
        return model_dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str = ""
    protect_metrics: bool = False  # with api_key: /metrics needs the key too
    protect_health: bool = False  # with api_key: /health needs the key too
    served_model_name: str = ""  # "": the loaded model's name (its directory's or file's, or the built-in's)
    max_body_bytes: int = 1 << 20
    shutdown_grace_ms: int = 5000  # on SIGINT/SIGTERM: how long in-flight generations may run on
    allowed_origins: str = ""  # browsers' cross-origin calls (CORS): "" none, "*" any, or "https://a.example,http://localhost:3000"

    def validate(self) -> None:
        _require(0 <= self.port <= 65535, "port", "must be in 0..65535")
        _require(bool(self.host), "host", "must not be empty")
        _require(self.max_body_bytes >= 1024, "max_body_bytes", "must be >= 1024")
        _require(self.shutdown_grace_ms >= 0, "shutdown_grace_ms", "must be >= 0")
        for key in ("protect_metrics", "protect_health"):  # with no key there is nothing to protect with
            _require(bool(self.api_key) or not getattr(self, key), key, "needs an api_key (it would protect nothing)")
        self.origins()

    def origins(self) -> frozenset[str]:
        """`allowed_origins` as a set; each entry is "*" or an origin exactly as a browser sends it
        in its Origin header (compared as strings): scheme://host[:port], lower case, without the
        scheme's default port, a path or a trailing slash."""
        origins = frozenset(o.strip() for o in self.allowed_origins.split(",") if o.strip())
        _require(bool(origins) or not self.allowed_origins.strip(), "allowed_origins", "lists no origin")
        for origin in origins - {"*"}:
            canonical = _origin(origin)
            _require(canonical == origin, "allowed_origins",
                     f"has {origin!r}, which is not '*' or an origin as browsers send it (scheme://host[:port], "
                     "lower case, no default port, path or trailing slash)" + (f": write {canonical!r}" if canonical else ""))
        return origins


@dataclass(frozen=True)
class ClusterConfig:
    replicas: int = 0  # 0 = one engine in this process; N >= 1 = N engine replicas on Ray Serve
    ray_address: str = ""  # empty = start a local Ray; else join this cluster ("auto", "host:6379")
    ray_num_cpus: int = 0  # local Ray only: CPUs it may use; 0 = what the replicas ask for, rounded up
    router: str = "prefix"
    replica_cpus: float = 1.0  # Ray CPU share of one replica; its torch threads too, unless num_threads is set
    replica_gpus: float = 0.0
    balance_abs_threshold: int = 8  # prefix router: leave the prefix's replica when its load exceeds
    balance_rel_threshold: float = 1.5  # the least-loaded one's by more than abs AND more than rel times
    max_prefix_entries: int = 65536  # prefix router: block hashes remembered (LRU)
    prefix_min_share: float = 0.5  # prefix router: follow a known prefix only if it is this share of the prompt
    health_check_ms: int = 1000  # how often the ingress probes each replica

    def validate(self) -> None:
        _require(self.replicas >= 0, "replicas", "must be >= 0")
        _require(self.ray_num_cpus >= 0, "ray_num_cpus", "must be >= 0")
        _require(self.router in ROUTERS, "router", f"must be one of {ROUTERS}")
        _require(self.replica_cpus > 0, "replica_cpus", "must be > 0")
        _require(self.replica_gpus >= 0, "replica_gpus", "must be >= 0")
        _require(self.balance_abs_threshold >= 0, "balance_abs_threshold", "must be >= 0")
        _require(self.balance_rel_threshold >= 1.0, "balance_rel_threshold", "must be >= 1.0")
        _require(self.max_prefix_entries >= 1, "max_prefix_entries", "must be >= 1")
        _require(0.0 <= self.prefix_min_share <= 1.0, "prefix_min_share", "must be in [0, 1]")
        _require(self.health_check_ms >= 10, "health_check_ms", "must be >= 10")
        _require(not (self.ray_address and self.ray_num_cpus), "ray_num_cpus",
                 "sizes a local Ray only; with ray_address the cluster's own CPUs are used: remove it")
        # one engine in this process: a cluster setting would be silently unused
        if self.replicas == 0 and (unused := self._set_keys()):
            _require(False, unused[0], "has no effect with replicas = 0 (one engine in this process); "
                     "set [cluster] replicas >= 1 (or --replicas N) or remove it")

    def unread_router_keys(self) -> list[str]:
        """Prefix-router keys set (away from their defaults) under another router, which never
        reads them. Not refused by validate: engine-sim may sweep the router with them set."""
        if self.router == "prefix":
            return []
        return [name for name in self._set_keys() if name in PREFIX_ROUTER_KEYS]

    def _set_keys(self) -> list[str]:
        """The keys set away from their defaults."""
        return [f.name for f in fields(self) if getattr(self, f.name) != f.default]


SECTIONS = {"model": ModelConfig, "scheduler": SchedulerConfig, "cache": CacheConfig, "server": ServerConfig,
            "cluster": ClusterConfig}


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    @property
    def served_model_name(self) -> str:
        """The model's name in the API: `[server] served_model_name`, else the loaded model's."""
        return self.server.served_model_name or model_display_name(self.model.model)

    @property
    def model_names(self) -> frozenset[str]:
        """Names a request may give: the served name, and the model as configured (its path)."""
        return frozenset({self.served_model_name, self.model.model})

    def __post_init__(self) -> None:
        for name, section_cls in SECTIONS.items():
            section = getattr(self, name)
            if not isinstance(section, section_cls):
                raise ValueError(f"config section {name!r} must be a {section_cls.__name__}, got "
                                 f"{type(section).__name__} {section!r} (flat keys: EngineConfig().with_overrides(...))")
            hints = get_type_hints(section_cls)
            for f in fields(section):  # a section built in code has had no type check yet
                _check_type(f.name, getattr(section, f.name), hints[f.name])
            section.validate()

    @classmethod
    def load(cls, path: str | os.PathLike | None = DEFAULT_CONFIG, **overrides: Any) -> EngineConfig:
        """Read `path` (None = built-in defaults), then apply flat keyword overrides."""
        raw: dict[str, Any] = {}
        if path is not None:
            with open(path, "rb") as f:
                try:
                    raw = tomllib.load(f)
                except tomllib.TOMLDecodeError as e:
                    raise ValueError(f"{path}: not valid TOML: {e}") from None
        return cls.from_dict(raw, **overrides)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], **overrides: Any) -> EngineConfig:
        unknown = set(raw) - set(SECTIONS)
        if unknown:
            raise ValueError(f"unknown config section(s): {sorted(unknown)}; expected {list(SECTIONS)}")
        sections = {}
        for name, section_cls in SECTIONS.items():
            if not isinstance(raw.get(name, {}), dict):  # `model = "x"` at the top, `[[scheduler]]`
                raise ValueError(f"config section [{name}] must be a table of keys, got {type(raw[name]).__name__} "
                                 f"{raw[name]!r} (a key goes under its section's [header])")
            values = dict(raw.get(name, {}))
            known = {f.name for f in fields(section_cls)}
            bad = set(values) - known
            if bad:
                raise ValueError(f"unknown key(s) {sorted(bad)} in [{name}]; known: {sorted(known)}")
            sections[name] = _build(section_cls, values)
        return cls(**sections).with_overrides(**overrides)

    def with_overrides(self, **overrides: Any) -> EngineConfig:
        """A copy with flat keys replaced, e.g. `config.with_overrides(policy="static")`."""
        updates: dict[str, dict[str, Any]] = {}
        for key, value in overrides.items():
            section = section_of(key)
            updates.setdefault(section, {})[key] = value
        changed = {}
        for section, values in updates.items():
            current = dataclasses.asdict(getattr(self, section))
            current.update(values)
            changed[section] = _build(SECTIONS[section], current)
        return replace(self, **changed)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)


def section_of(key: str) -> str:
    for name, section_cls in SECTIONS.items():
        if key in {f.name for f in fields(section_cls)}:
            return name
    raise ValueError(f"unknown config key {key!r}")


def all_keys() -> dict[str, tuple[str, type]]:
    """key -> (section, python type); used to build CLI flags 1:1."""
    out = {}
    for name, section_cls in SECTIONS.items():
        hints = get_type_hints(section_cls)
        for f in fields(section_cls):
            out[f.name] = (name, hints[f.name])
    return out


_BOOLS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def parse_value(key: str, text: str) -> Any:
    """A config key's value from command-line text (a bool key takes true/false, yes/no, on/off or
    1/0; anything else is refused, never read as false)."""
    keys = all_keys()
    if key not in keys:
        raise ValueError(f"unknown config key {key!r}")
    typ = keys[key][1]
    if typ is bool:
        if text.lower() not in _BOOLS:
            raise ValueError(f"config key {key!r}: bad value {text!r} (true/false, yes/no, on/off or 1/0)")
        return _BOOLS[text.lower()]
    try:
        return typ(text)
    except ValueError:
        raise ValueError(f"config key {key!r}: bad value {text!r}") from None


def config_path(given: str | None) -> str | None:
    """The config file a command reads: `--config PATH` as given (a missing one is an error when
    it is opened), else ./config.toml when there is one, else None (the built-in defaults)."""
    if given is not None:
        return given
    return DEFAULT_CONFIG if Path(DEFAULT_CONFIG).is_file() else None


def parse_sweep(spec: str) -> tuple[str, list[str]]:
    """`--sweep KEY=V1,V2,...` -> (KEY, [V1, V2, ...]). Each run is named by its value, so a
    value given twice is refused (its second run would silently replace the first's figures)."""
    key, _, values = spec.partition("=")
    if not values:
        raise ValueError("--sweep wants KEY=V1,V2,...")
    listed = values.split(",")
    twice = sorted({v for v in listed if listed.count(v) > 1})
    if twice:
        raise ValueError(f"--sweep {key}: {', '.join(map(repr, twice))} given more than once")
    return key, listed


def _build(section_cls: type, values: dict[str, Any]) -> Any:
    hints = get_type_hints(section_cls)
    for key, value in list(values.items()):
        if hints[key] is float and isinstance(value, int) and not isinstance(value, bool):
            values[key] = float(value)  # `priority_aging_s = 30` means 30.0
    return section_cls(**values)


def _check_type(key: str, value: Any, expected: type) -> None:
    """`value` is of the key's type: bool is no int (`port = true` is refused), an int is a float;
    a float must be finite (inf or nan would pass every range check)."""
    number = expected is float and isinstance(value, int) and not isinstance(value, bool)
    ok = number or (isinstance(value, expected) and not (expected is not bool and isinstance(value, bool)))
    if not ok:
        raise ValueError(f"config key {key!r}: expected {expected.__name__}, got {type(value).__name__} {value!r}")
    _require(not isinstance(value, float) or math.isfinite(value), key, "must be a finite number")


def _origin(text: str) -> str | None:
    """`text` as a browser serializes its origin, or None if it names none (a path, a user, a
    fragment, a space, a bad port)."""
    parts = urlsplit(text)
    try:
        port = parts.port
    except ValueError:
        return None
    if (not parts.scheme or not parts.hostname or parts.path or parts.query or "#" in text or "@" in parts.netloc
            or any(c.isspace() for c in text)):
        return None
    scheme, host = parts.scheme.lower(), parts.hostname  # urlsplit lower-cases the host
    host = f"[{host}]" if ":" in host else host
    default = {"http": 80, "https": 443}.get(scheme)
    return f"{scheme}://{host}" + (f":{port}" if port is not None and port != default else "")


def _require(ok: bool, key: str, why: str) -> None:
    if not ok:
        raise ValueError(f"config key {key!r} {why}")
