"""The appliance profile: one TOML file that says what to serve, where, and within which limits.

Loaded with tomllib into pydantic models that forbid unknown keys, so a typo is an error naming its
key path (`models[0].kv_fration: unknown key`), never a silently ignored setting. Each model (each
replica of one) has a ring region (`region_name`, `ring_geometry`) and an engine process of its own.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

from blink_appliance.profile_checks import engine_errors, model_set_errors
from blink_appliance.profile_errors import ProfileError, key_path, message
from blink_appliance.wire.engine_watch import ENGINE_STALL_LIMIT_S
from blink_appliance.wire.link_settings import DpuSection
from blink_appliance.wire.prefix_hash import prompt_words
from blink_appliance.wire.ring_layout import RingGeometry

_SHM_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ApplianceSection(_Section):
    name: str = "blink"
    # POSIX shared-memory name of the ring region; one appliance per name on a host.
    shm_name: str = "blink-appliance"
    engine_cpus: list[int] = Field(default_factory=list)  # pin the engine process (empty: no pinning)
    engine_restarts: int = Field(default=5, ge=0)  # crashes tolerated before the daemon gives up
    drain_timeout_s: float = Field(default=30.0, gt=0)  # in-flight work gets this long on SIGTERM
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @field_validator("shm_name")
    @classmethod
    def _shm_name_ok(cls, v: str) -> str:
        if not _SHM_NAME.match(v):
            raise ValueError("must be 1-200 characters of letters, digits, '_', '.', '-'")
        return v


# A request priority: an int32 (the ring record's field), lower runs first. Strict: TOML's `true` or
# "5" are errors, not 1 and 5.
Priority = Annotated[StrictInt, Field(ge=-(2**31), le=2**31 - 1)]


class ModelSection(_Section):
    name: str  # the id clients pass as "model"
    source: str | None = None  # hf:<dir>, gguf:<file>, dummy:<preset> or a named model; default: name
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # "quantized": a GGUF's Q4_0/Q4_1/Q8_0 matrices stay as codes, multiplied by torch's CPU int4
    # kernel (model/quantized_linear.py); "dequantized": fp weights, the reference's exact numerics.
    cpu_weights: Literal["dequantized", "quantized"] = "dequantized"
    device: str = "cpu"
    max_seqs: int = Field(default=32, ge=1, le=4096)
    max_model_len: int = Field(default=2048, ge=16)
    max_num_batched_tokens: int = Field(default=512, ge=16)  # token budget of one engine step
    max_prompt_tokens: int | None = Field(default=None, ge=1)  # default: max_model_len - 1
    max_output_tokens: int | None = Field(default=None, ge=1)  # default: max_model_len - 1
    kv_budget_gib: float | None = None
    kv_fraction: float | None = None
    block_size: int = Field(default=16, ge=1, le=1024)
    sm_count: int | None = Field(default=None, ge=1)  # SMs of this model's partition (GPU loop only)
    seed: int = 0  # seed of dummy: weights
    # The priority class of this model's requests (lower runs first) when the request's API key has
    # none; a request may lower its own priority (a larger number), never raise it (docs/api.md).
    priority: Priority = 0
    # Engines of this model, one per device (docs/profile.md, "Replicas"); the front end sends each
    # request to the one with the fewest outstanding tokens. `devices`: default device, cuda:N+1, ...
    replicas: int = Field(default=1, ge=1, le=64)
    # Ranks of one engine over several GPUs of this host, each with its share of the heads and the
    # MLP (docs/tensor_parallel.md): 1 or 2. `devices` then lists the ranks' GPUs.
    tensor_parallel: int = Field(default=1, ge=1, le=2)
    devices: list[str] | None = None
    _replica: int = PrivateAttr(default=0)  # which of the replicas this section is, once expanded
    _section: int = PrivateAttr(default=0)  # the [[models]] entry it comes from, as declared

    @property
    def replica(self) -> int:
        return self._replica

    def key(self, name: str = "", *, replica: bool = False) -> str:
        """This section's key path as the file declares it (`models[1].kv_fraction`): errors name what
        the user wrote, not the expanded list. `replica`: say which one, when it has several."""
        path = f"models[{self._section}]" + (f".{name}" if name else "")
        return path + (f" (replica {self._replica}: {self.device})" if replica and self.replicas > 1 else "")

    @property
    def section(self) -> int:
        return self._section

    @property
    def rank_devices(self) -> list[str]:
        """The GPUs of this engine's tensor-parallel ranks, rank 0's (`device`) first."""
        if self.tensor_parallel == 1:
            return [self.device]
        if self.devices:
            return list(self.devices)
        first = int(self.device[5:]) if self.device.startswith("cuda:") else 0
        return [f"cuda:{first + r}" for r in range(self.tensor_parallel)]

    @field_validator("device", "devices")
    @classmethod
    def _device_ok(cls, v: str | list[str] | None) -> str | list[str] | None:
        for device in [v] if isinstance(v, str) else v or []:
            if not (device == "cpu" or re.fullmatch(r"cuda:\d+", device)):
                raise ValueError(f"{device!r}: expected 'cpu' or 'cuda:N'")
        return v

    @field_validator("kv_budget_gib")
    @classmethod
    def _budget_ok(cls, v: float | None) -> float | None:
        if v is not None and not v > 0:
            raise ValueError(f"must be > 0, got {v}")
        return v

    @field_validator("kv_fraction")
    @classmethod
    def _fraction_ok(cls, v: float | None) -> float | None:
        if v is not None and not 0 < v <= 1:
            raise ValueError(f"must be in (0, 1], got {v}")
        return v

    @field_validator("block_size")
    @classmethod
    def _block_pow2(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"must be a power of two, got {v}")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> ModelSection:
        if (self.kv_budget_gib is None) == (self.kv_fraction is None):
            raise ValueError("set exactly one of kv_budget_gib and kv_fraction")
        if self.tensor_parallel > 1 and self.replicas > 1:
            raise ValueError("tensor_parallel with replicas is not built: one tensor-parallel engine a model")
        if self.devices is not None and len(self.devices) != self.replicas * self.tensor_parallel:
            what = (
                f"{self.replicas} replicas" if self.tensor_parallel == 1 else f"{self.tensor_parallel} ranks"
            )
            raise ValueError(f"devices lists {len(self.devices)} devices for {what}")
        if self.tensor_parallel > 1 and len(set(self.rank_devices)) != self.tensor_parallel:
            raise ValueError("devices lists a device twice: each rank needs a GPU of its own")
        for key in ("max_prompt_tokens", "max_output_tokens"):
            value = getattr(self, key)
            if value is not None and value >= self.max_model_len:
                raise ValueError(f"{key} ({value}) must be < max_model_len ({self.max_model_len})")
        if self.max_num_batched_tokens < self.max_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_seqs "
                f"({self.max_seqs}): every running sequence needs one token of the step budget"
            )
        return self

    @property
    def model_source(self) -> str:
        return self.source if self.source is not None else self.name

    @property
    def prompt_limit(self) -> int:
        return self.max_prompt_tokens if self.max_prompt_tokens is not None else self.max_model_len - 1

    @property
    def output_limit(self) -> int:
        return self.max_output_tokens if self.max_output_tokens is not None else self.max_model_len - 1


_KEY_RULE = "each key must be at least 8 characters without whitespace"


def _key_ok(key: str) -> str:
    if len(key) < 8 or any(c.isspace() for c in key):
        raise ValueError(_KEY_RULE)
    return key


class ApiKey(_Section):
    """One bearer key of `[frontend] api_keys`; `priority`: the class its requests run in (None: the
    model's `priority`)."""

    key: StrictStr
    priority: Priority | None = None

    @field_validator("key")
    @classmethod
    def _key_rule(cls, v: str) -> str:
        return _key_ok(v)


def _key_table(value: Any) -> Any:
    """A plain string entry is a key without a class; a table is validated as an ApiKey (so its
    errors name `frontend.api_keys[i].priority`)."""
    if isinstance(value, str):
        return {"key": _key_ok(value)}
    if isinstance(value, dict | ApiKey):
        return value
    raise ValueError('expected a key string or a table {key = "...", priority = N}')


ApiKeyEntry = Annotated[ApiKey, BeforeValidator(_key_table)]


class FrontendSection(_Section):
    host: str = "127.0.0.1"  # loopback unless the profile says otherwise
    port: int = Field(default=8000, ge=0, le=65535)  # 0: any free port (printed when ready)
    cpus: list[int] = Field(default_factory=list)  # pin the front-end process (empty: no pinning)
    # "shm": the front end shares the engine host's memory; "nixl": it reaches the rings over the
    # network through NIXL, from wherever [dpu] says it runs (docs/dpu.md).
    transport: Literal["shm", "nixl", "rdma"] = "shm"
    max_request_bytes: int = Field(default=1 << 20, ge=1024)  # larger bodies get 413
    max_inflight: int = Field(default=256, ge=1, le=65536)  # requests admitted at once; more get 503
    # (token, logprob) pairs, 8 bytes each, shared by the requests in flight that ask for logprobs
    # (a request takes (1 + N) per generated token, and per prompt token with echo); 0: refused.
    logprob_pairs: int = Field(default=1 << 20, ge=0, lt=2**31)
    # int32 words of the token automata of structured-output requests in flight (docs/api.md); 0: refused.
    constraint_words: int = Field(default=1 << 22, ge=0, lt=2**31)
    # Bearer keys: a string, or a table {key = "...", priority = N} whose requests run in class N
    # (docs/api.md, "Priority"); env BLINK_API_KEY adds one without a class.
    api_keys: list[ApiKeyEntry] = Field(default_factory=list)
    # A connection must send a whole request head within this long of opening, or of its last
    # response (so it is also the idle keep-alive limit); then it is closed.
    header_timeout_s: float = Field(default=15.0, gt=0.0, le=3600.0)
    body_timeout_s: float = Field(default=30.0, gt=0.0, le=3600.0)  # the whole body, once its head is in; 408
    # A request not finished this long after it was accepted is cancelled; its stream ends with an
    # error event (0: no limit). OpenAI's own clients give up after 600 s.
    request_timeout_s: float = Field(default=600.0, ge=0.0)

    @field_validator("transport")
    @classmethod
    def _transport_built(cls, v: str) -> str:
        if v == "rdma":
            raise ValueError("'rdma' is spelled 'nixl': NIXL's UCX backend does RDMA where the NIC has it")
        return v

    @field_validator("api_keys")
    @classmethod
    def _keys_distinct(cls, v: list[ApiKey]) -> list[ApiKey]:
        first: dict[str, int] = {}
        for i, entry in enumerate(v):
            if entry.key in first:  # with classes, which one would a request get?
                raise ValueError(f"[{i}] repeats the key of [{first[entry.key]}]; list each key once")
            first[entry.key] = i
        return v

    @property
    def bearer_keys(self) -> list[str]:
        return [entry.key for entry in self.api_keys]


EngineMode = Literal["reference", "loop", "host"]
# Forward sizes captured by default, cut at the step budget (ForwardGraphs' default too). 1, 2 and 4
# take the 8-token bucket's launch plans over fewer rows (8B batch 1: 5.621 -> 5.454 ms a step;
# bench/results/2026-11-28-h100-small-buckets.md).
DEFAULT_BUCKETS = (1, 2, 4, 8, 32, 128, 512, 2048)


class EngineSection(_Section):
    """Which engine serves the model, and the GPU loop's capacities. Modes: "reference", the CPU
    reference engine; "loop", the device-resident loop launched once (CUDA only); "host", the loop's
    kernels one synchronized step per host call (the baseline; CI runs it on "cpu", interpreted)."""

    mode: EngineMode | None = None  # default: "reference" on cpu, "loop" on cuda:N
    num_slots: int | None = Field(default=None, ge=1, le=65536)  # requests the loop holds at once
    buckets: list[int] | None = None  # captured forward sizes, ascending, ending at the step budget
    # True: no atomics in the forward (O and down sum split-K partials in a fixed order), the same step
    # gives the same logits every run, 3-5% slower (1B decode). Default: fp32 atomics into the stream.
    deterministic: bool | None = None
    # A waiting request's priority improves by one per this many engine steps it has waited (never past
    # the most urgent live request's class); 0: no aging. Both engines (docs/engine.md, "Scheduling").
    priority_aging_steps: int = Field(default=0, ge=0, le=2**31 - 1)
    # While the most urgent running class runs, at most this many running requests of lower classes
    # step beside it (the rest are held with their KV); 0 pauses them; unset: no cap (docs/engine.md).
    lower_class_limit: int | None = Field(default=None, ge=0, le=2**31 - 1)
    # Best-effort requests (priority >= best_effort_priority) take turns, this many stepping at once, so an
    # urgent arrival waits out a short step; unset: all step. Both engines (docs/engine.md, "Scheduling").
    best_effort_batch: int | None = Field(default=None, ge=1, le=2**31 - 1)
    best_effort_priority: int = Field(default=1, ge=-(2**31), le=2**31 - 1)
    # Reuse the KV blocks of prompt prefixes already computed (docs/engine.md, "Prefix cache"). Both engines.
    prefix_cache: bool = True
    # How long the engine's heartbeat may stand still before the front end fails its open streams and
    # the daemon restarts it (docs/reliability.md); raise it where a crowded host can stall a live engine.
    stall_limit_s: float = Field(default=ENGINE_STALL_LIMIT_S, gt=0.0, le=3600.0)

    @field_validator("buckets")
    @classmethod
    def _buckets_ok(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and (not v or v[0] < 1 or v != sorted(set(v))):
            raise ValueError(f"must be distinct positive token counts in ascending order, got {v}")
        return v

    @property
    def class_cap(self) -> int:
        """lower_class_limit as both engines take it: -1 for no cap."""
        return -1 if self.lower_class_limit is None else self.lower_class_limit

    @property
    def scheduling(self) -> dict[str, int | bool]:
        """The scheduler's settings as both engines take them (EngineConfig, LoopGeometry): -1 for unset."""
        return dict(
            priority_aging_steps=self.priority_aging_steps, lower_class_limit=self.class_cap,
            best_effort_batch=self.best_effort_batch or -1, best_effort_priority=self.best_effort_priority,
            prefix_cache=self.prefix_cache,
        )  # fmt: skip


class TelemetrySection(_Section):
    enabled: bool = True  # serves /telemetry and /telemetry/stream for `blink-appliance top`
    interval_s: float = Field(default=0.5, gt=0, le=60)


class Profile(_Section):
    appliance: ApplianceSection = Field(default_factory=ApplianceSection)
    models: list[ModelSection]
    frontend: FrontendSection = Field(default_factory=FrontendSection)
    engine: EngineSection = Field(default_factory=EngineSection)
    telemetry: TelemetrySection = Field(default_factory=TelemetrySection)
    dpu: DpuSection | None = None

    @field_validator("models")
    @classmethod
    def _some_models(cls, v: list[ModelSection]) -> list[ModelSection]:
        """Each section with N replicas becomes N sections of one name, an engine each."""
        if not v:
            raise ValueError("at least one [[models]] entry is required")
        return [_replica(m, d, k) for d, m in enumerate(v) for k in range(m.replicas)]

    @model_validator(mode="after")
    def _dpu_with_nixl(self) -> Profile:
        nixl = self.frontend.transport == "nixl"
        if nixl and self.dpu is None:
            raise ValueError("frontend.transport 'nixl' needs a [dpu] section (where the front end runs)")
        if not nixl and self.dpu is not None:
            raise ValueError(
                f"dpu: used only with frontend.transport = 'nixl' (not {self.frontend.transport!r})"
            )
        return self

    @property
    def model(self) -> ModelSection:
        """The one model of a single-model profile (several need an index: none serves models[0] by accident)."""
        return self.models[self._only_index()]

    def _only_index(self) -> int:
        if len(self.models) > 1:
            raise ProfileError(f"the profile has {len(self.models)} models; use profile.models[i]")
        return 0

    # The single-model views of the per-model answers below (tests and one-model tools use them).
    @property
    def engine_mode(self) -> EngineMode:
        return self.engine_mode_of(self._only_index())

    @property
    def uses_loop(self) -> bool:
        return self.uses_loop_of(self._only_index())

    @property
    def num_slots(self) -> int:
        return self.num_slots_of(self._only_index())

    @property
    def buckets(self) -> tuple[int, ...]:
        return self.buckets_of(self._only_index())

    def engine_mode_of(self, index: int) -> EngineMode:
        """engine.mode when set (it applies to every model), else by models[index].device."""
        cpu = self.models[index].device == "cpu"
        return self.engine.mode if self.engine.mode is not None else "reference" if cpu else "loop"

    def uses_loop_of(self, index: int) -> bool:
        """Served by the GPU loop's code (mode "loop" or "host"), not the CPU reference engine."""
        return self.engine_mode_of(index) != "reference"

    def num_slots_of(self, index: int) -> int:
        """Loop slots: every request the front end may have in flight, and at least one step's batch."""
        slots = self.engine.num_slots
        return slots if slots is not None else max(self.models[index].max_seqs, self.frontend.max_inflight)

    def buckets_of(self, index: int) -> tuple[int, ...]:
        if self.engine.buckets is not None:
            return tuple(self.engine.buckets)
        budget = self.models[index].max_num_batched_tokens
        return tuple(b for b in DEFAULT_BUCKETS if b < budget) + (budget,)

    def with_overrides(self, *, host: str | None = None, port: int | None = None) -> Profile:
        """A copy with the front end's address replaced (validated like the file)."""
        data = self.model_dump()
        data["models"] = [m.model_dump() for m in self.models if not m.replica]  # as declared
        if host is not None:
            data["frontend"]["host"] = host
        if port is not None:
            data["frontend"]["port"] = port
        return parse_profile(data)


def _replica(m: ModelSection, section: int, k: int) -> ModelSection:
    """Replica k of the declared section `section`, `m`: on devices[k], or the k-th CUDA device from
    `device` on."""
    on_cuda = m.device != "cpu"
    device = m.devices[k] if m.devices else f"cuda:{int(m.device[5:]) + k}" if on_cuda else m.device
    copy = m.model_copy(update={"device": device})
    copy._replica, copy._section = k, section
    return copy


def parse_profile(data: dict[str, Any], *, origin: str = "profile") -> Profile:
    try:
        profile = Profile.model_validate(data)
    except ValidationError as e:
        lines = [f"  {key_path(tuple(err['loc']))}: {message(err)}" for err in e.errors()]
        raise ProfileError(f"{origin} is invalid:\n" + "\n".join(lines)) from None
    errors = list(dict.fromkeys(model_set_errors(profile) + engine_errors(profile)))  # replicas repeat theirs
    if errors:
        raise ProfileError(f"{origin} is invalid:\n" + "\n".join(f"  {line}" for line in errors))
    return profile


def load_profile(path: str | os.PathLike[str]) -> Profile:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ProfileError(f"profile not found: {p}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ProfileError(f"{p}: not valid TOML: {e}") from None
    return parse_profile(data, origin=str(p))


def ring_geometry(profile: Profile, index: int = 0) -> RingGeometry:
    """The ring capacities of models[index]'s region, which its engine and the front end derive alike."""
    m = profile.models[index]
    inflight, hashed = profile.frontend.max_inflight, m.block_size if profile.engine.prefix_cache else 0
    return RingGeometry(
        request_slots=inflight,
        arena_tokens=max(prompt_words(m.prompt_limit, hashed), min(inflight * m.prompt_limit, 1 << 20)),
        max_prompt_tokens=m.prompt_limit,
        max_inflight=inflight,
        max_output_tokens=m.output_limit,
        max_stop_ids=16,
        logprob_pairs=profile.frontend.logprob_pairs,
        prefix_block_size=hashed,
        constraint_words=profile.frontend.constraint_words,
    )


def region_name(profile: Profile, index: int) -> str:
    """The shared-memory name of models[index]'s ring region: models[0] keeps appliance.shm_name
    (so a one-model appliance is where it always was), models[i] adds "-i"."""
    if not 0 <= index < len(profile.models):
        raise IndexError(f"models[{index}]: the profile has {len(profile.models)} models")
    name = profile.appliance.shm_name
    return name if index == 0 else f"{name}-{index}"
