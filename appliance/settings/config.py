"""The appliance's one settings model.

Values come, highest priority first, from: keyword arguments (the CLI's flags),
environment variables (`APPLIANCE_*`, nested sections as `APPLIANCE_KV__BLOCK_SIZE`),
an optional TOML file (the `config` setting, the same keys as the variables), then the
defaults below. Nothing else reads the environment. A Settings is plain data: it is what
travels to every worker process.
"""

from __future__ import annotations

import ipaddress
import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from appliance.model.sampling_defaults import API_OWN, MODEL_OWN, checked
from appliance.settings.cluster import ClusterSettings

# Re-exported: `from appliance.settings.config import BatchSettings, KVSettings` stays the import.
from appliance.settings.engine import BatchSettings, KVSettings, SpeculativeSettings
from appliance.settings.kv_store import KVStoreSettings
from appliance.settings.planner import PlannerSettings
from appliance.settings.tracing import TracingSettings


class SettingsError(ValueError):
    """A setting has a bad value; the message names the setting."""


# Device indices, sorted, each once; None: split automatically. NoDecode: pydantic-settings
# would read a tuple's environment variable as JSON, and '0,1' or '0-3' is not JSON.
DeviceList = Annotated[tuple[NonNegativeInt, ...] | None, NoDecode]
# Origins as a browser writes them in its Origin header; a variable or flag holds them
# comma-separated (NoDecode: not as JSON).
OriginList = Annotated[tuple[str, ...], NoDecode]
ORIGIN = re.compile(r"https?://[^/\s,?#@]+/?")


class ServerSettings(BaseModel):
    """Limits of the HTTP server."""

    model_config = ConfigDict(extra="forbid")

    max_body_bytes: int = Field(
        4 * 2**20, ge=1024, description="Largest request body accepted; larger ones get 413."
    )
    max_concurrent_requests: int = Field(
        256,
        ge=1,
        description="Generations in flight (each of n choices counts); beyond it 429.",
    )
    max_n: int = Field(16, ge=1, le=128, description="Most choices (n) one request may ask for.")
    trust_request_chat_template: bool = Field(
        False,
        description="Render a chat request's own `chat_template` (vLLM's "
        "--trust-request-chat-template); off, such a request is a 400. A template is code "
        "the server runs (sandboxed, as transformers renders them): trust the clients.",
    )
    responses_kept: int = Field(
        1000,
        ge=0,
        description="Responses kept for previous_response_id and GET /v1/responses/{id}: "
        "the newest, in memory until a restart; 0 keeps none.",
    )
    request_timeout_s: float | None = Field(
        600.0,
        gt=0,
        description="A generation still running after this long ends with an error; "
        "empty means no deadline.",
    )
    shutdown_timeout_s: float = Field(
        30.0,
        ge=0,
        description="On SIGTERM/SIGINT: new requests get 503 and running ones may finish "
        "for this long; what still runs then ends with an error event.",
    )
    allowed_origins: OriginList = Field(
        (),
        description="Origins besides the server's own whose browser pages may call it "
        "(scheme://host[:port], comma-separated), e.g. a reverse proxy's "
        "https://chat.example.com; their host names pass the loopback Host check too. "
        "No CORS headers are sent.",
    )

    ssl_certfile: Path | None = Field(
        None,
        description="Serve HTTPS with this certificate (PEM, its chain after it), as vLLM's "
        "--ssl-certfile; needs ssl_keyfile. Empty: plain HTTP.",
    )
    ssl_keyfile: Path | None = Field(
        None, description="The private key of ssl_certfile (vLLM's --ssl-keyfile)."
    )

    @field_validator("allowed_origins", mode="before")
    @classmethod
    def _read_origins(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(part.strip() for part in value.split(",") if part.strip())
        return value

    @field_validator("allowed_origins")
    @classmethod
    def _are_origins(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for origin in value:
            if not ORIGIN.fullmatch(origin):
                raise ValueError(
                    f"{origin!r} is not an origin: write scheme://host[:port], "
                    "e.g. https://chat.example.com"
                )
        return value


class RecoverySettings(BaseModel):
    """What happens when a worker crashes or stalls."""

    model_config = ConfigDict(extra="forbid")

    max_crashes: int = Field(
        3, ge=1, description="Crashes of one device within crash_window_s that mark it failed."
    )
    crash_window_s: float = Field(60.0, gt=0, description="See max_crashes.")
    max_request_retries: int = Field(
        2, ge=0, description="How often one request is re-run after losing its worker."
    )
    stall_timeout_s: float = Field(
        120.0,
        gt=0,
        description="A worker with work that reports no step for this long is killed "
        "(and restarted).",
    )
    start_timeout_s: float = Field(
        300.0, gt=0, description="How long a worker may take to load the model."
    )


class AdminSettings(BaseModel):
    """The admin API (/admin) that the console uses."""

    model_config = ConfigDict(extra="forbid")

    token_file: Path | None = Field(
        None,
        description="Where the server writes its admin token (mode 0600) at start; empty "
        "means <cache_dir>/admin/<port>.token.",
    )
    events_interval_s: float = Field(
        0.5, gt=0, le=60, description="Seconds between state snapshots on /admin/events."
    )
    drain_timeout_s: float = Field(
        120.0,
        gt=0,
        description="How long a moving device's worker may take to finish its requests; "
        "past it the move is called off and the worker stays in its pool.",
    )


class Settings(BaseSettings):
    """Everything the appliance can be told."""

    model_config = SettingsConfigDict(
        env_prefix="APPLIANCE_",
        env_nested_delimiter="__",
        extra="forbid",
        validate_default=True,
        populate_by_name=True,
    )

    config: Path | None = Field(
        None,
        description="TOML settings file, the same keys as the APPLIANCE_* variables "
        "([kv] block_size = 16); flags and variables override it.",
    )
    model: Path | None = Field(
        None,
        description="GGUF file, Hugging Face folder, or a model in the local Hugging Face "
        "cache by name (org/name, org/name:Q4_K_M for one GGUF quant; `appliance pull` "
        "fetches one); empty means the embedded SmolLM2.",
    )
    chat_template: str | None = Field(
        None,
        description="A Jinja chat template file, or the template itself, rendering chat "
        "messages in place of the model's own template (vLLM's --chat-template).",
    )
    generation_config: str = Field(
        MODEL_OWN,
        description="Sampling defaults for the fields a request leaves out (vLLM's "
        "--generation-config): auto takes the model's recommended ones (its "
        "generation_config.json, a GGUF's general.sampling.* keys); vllm takes the API's "
        "own (temperature 1, no cuts); or a folder holding a generation_config.json.",
    )
    override_generation_config: dict[str, float] = Field(
        default_factory=dict,
        description="Sampling defaults set here, over generation_config's (vLLM's name): "
        "temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens, as JSON "
        '({"temperature": 0.7}) or a TOML table.',
    )
    revision: str | None = Field(
        None,
        description="With a model by name: the branch, tag or commit of its repository; "
        "empty means main.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights and activations dtype; auto picks per device."
    )
    kv_cache_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="The dtype the KV cache keeps keys and values in (vLLM's name): auto "
        "keeps the activations' dtype; bfloat16 on a float32 CPU worker holds twice the "
        "tokens in the same bytes (rounded as written). On CUDA only the activations' dtype.",
    )
    weights: Literal["auto", "dense", "quantized"] = Field(
        "auto",
        description="quantized multiplies a GGUF's block-format weights (Q4_0, Q4_1, Q8_0, "
        "Q4_K, Q5_K, Q6_K) in place, reading a fraction of the bytes: with the CPU kernels, "
        "or on CUDA with the Triton kernels (every one of these formats) "
        "(int4 is an older name for it); auto does so wherever that applies (kernels "
        "built); dense dequantizes all to the dtype.",
    )
    quantize: Literal["none", "q8_0", "q4_0"] = Field(
        "none",
        description="On the quantized path, quantize float weights (an F16/F32 GGUF, a "
        "Hugging Face folder) at load to this block format; none keeps them dense.",
    )
    cpu_isa: Literal["auto", "avx512", "avx2", "generic"] = Field(
        "auto",
        description="The highest instruction-set level the CPU kernels may use; auto takes "
        "the best this CPU has (a cap: a level the CPU lacks falls to the next below).",
    )
    prefill_gemm: Literal["auto", "float32", "bfloat16", "int16"] = Field(
        "auto",
        description="Quantized path: the type a prompt's GEMM (see prefill_gemm_rows) "
        "multiplies in: bfloat16 (2^-9; auto with AVX512-BF16 at cpu level avx512), int16 "
        "activations (auto at other avx2/avx512 levels; Q4_0/Q4_1/Q8_0) or float32.",
    )
    prefill_gemm_rows: Literal["auto"] | int = Field(
        "auto",
        description="Quantized path: from how many prompt rows in a step the products "
        "dequantize the weights for a GEMM (prefill_gemm) instead of the integer kernel. "
        "auto takes the crossover measured for this CPU's kernel level and GEMM type "
        "(a table, not a timing at start). Decode-only steps stay on the integer kernel "
        "whatever the batch.",
    )

    @field_validator("prefill_gemm_rows", mode="before")
    @classmethod
    def _row_count_or_auto(cls, value: Any) -> Any:
        """One clear error for what is neither auto nor a whole count of 1 or more."""
        if value == "auto":
            return value
        text = str(value).strip()
        if isinstance(value, bool) or not text.isdigit() or int(text) < 1:
            raise ValueError(f"must be auto or a row count of 1 or more, not {value!r}")
        return int(text)

    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Accelerator kind; auto takes CUDA when present."
    )
    cache_dir: Path = Field(
        Path.home() / ".cache" / "appliance",
        description="Where dequantized weights and converted tokenizers are cached.",
    )
    cpu_devices: int | None = Field(
        None,
        ge=1,
        description="Without GPUs: how many devices to split the usable cores into "
        "(each a worker's core set); empty means one per core.",
    )
    cpu_share_cores: bool = Field(
        False,
        description="Allow more CPU devices than cores: each device then gets one core, in "
        "turn, shared with others (to try pool layouts on a small machine).",
    )
    mode: Literal["disaggregated", "colocated"] = Field(
        "disaggregated", description="Split prefill and decode pools, or workers doing both."
    )
    prefill_devices: DeviceList = Field(
        None, description="Devices of the prefill pool, e.g. '0,1'; empty splits automatically."
    )
    decode_devices: DeviceList = Field(
        None,
        description="Devices of the decode pool, e.g. '2,3'; empty splits automatically; "
        "'none' with cluster.listen: this box only prefills, other boxes' agents decode.",
    )
    colocated_devices: DeviceList = Field(
        None,
        description="In disaggregated mode: devices whose workers prefill and decode alike "
        "(colocated) beside the two pools, e.g. '1'; prefill_devices and decode_devices "
        "then split the rest, and either pool may be empty as long as something prefills, "
        "something decodes and a prefill pool has a decode pool to hand off to.",
    )
    prefill_tp: int = Field(
        1,
        ge=1,
        le=64,
        description="Tensor-parallel degree of a prefill (or colocated) worker: how many "
        "devices one worker's model is split over, one process per shard.",
    )
    decode_tp: int = Field(1, ge=1, le=64, description="Tensor-parallel degree of a decode worker.")
    host: str = Field("127.0.0.1", description="Address the HTTP server binds to.")
    port: int = Field(8000, ge=0, le=65535, description="Port of the HTTP server.")
    allow_remote: bool = Field(
        False,
        description="Allow binding to a non-loopback host (other machines can then connect).",
    )
    api_key: SecretStr | None = Field(
        None, description="When set, /v1 requests need 'Authorization: Bearer <key>'."
    )
    served_model_name: str | None = Field(
        None, description="Model id clients send; empty means the model file's name."
    )
    notify_socket: str | None = Field(
        None,
        validation_alias=AliasChoices("notify_socket", "NOTIFY_SOCKET"),
        description="Set by systemd (NOTIFY_SOCKET): where READY/WATCHDOG/STATUS go.",
    )
    watchdog_usec: int | None = Field(
        None,
        ge=1,
        validation_alias=AliasChoices("watchdog_usec", "WATCHDOG_USEC"),
        description="Set by systemd (WATCHDOG_USEC): the watchdog period; pings every half.",
    )
    server: ServerSettings = Field(default_factory=ServerSettings)
    kv: KVSettings = Field(default_factory=KVSettings)
    kv_store: KVStoreSettings = Field(default_factory=KVStoreSettings)
    batch: BatchSettings = Field(default_factory=BatchSettings)
    speculative: SpeculativeSettings = Field(default_factory=SpeculativeSettings)
    planner: PlannerSettings = Field(default_factory=PlannerSettings)
    cluster: ClusterSettings = Field(default_factory=ClusterSettings)
    admin: AdminSettings = Field(default_factory=AdminSettings)
    recovery: RecoverySettings = Field(default_factory=RecoverySettings)
    tracing: TracingSettings = Field(default_factory=TracingSettings)

    @field_validator("model", mode="before")
    @classmethod
    def _empty_model_is_default(cls, value: object) -> object:
        return None if value is None or str(value) == "" else value

    @field_validator("chat_template")
    @classmethod
    def _template_from_file(cls, value: str | None) -> str | None:
        # A file is read here, once: what travels to workers is the template's text.
        if not value:
            return None
        if "{" not in value:  # a path: a template has Jinja tags
            path = Path(value).expanduser()
            if not path.is_file():
                raise ValueError(f"no such chat template file: {value}")
            return path.read_text()
        return value

    @field_validator("generation_config")
    @classmethod
    def _generation_config_found(cls, value: str) -> str:
        if value in (MODEL_OWN, API_OWN):
            return value
        path = Path(value).expanduser()
        if not (path / "generation_config.json").is_file() and not path.is_file():
            raise ValueError(
                f"{value!r} is neither auto, vllm, nor a folder with a generation_config.json"
            )
        return str(path)

    @field_validator("override_generation_config", mode="before")
    @classmethod
    def _overrides_from_text(cls, value: Any) -> Any:
        # A flag's value arrives as text (the variable's is parsed by the settings source).
        if isinstance(value, str):
            try:
                return json.loads(value) if value.strip() else {}
            except json.JSONDecodeError as exc:
                raise ValueError(f"not a JSON object: {value!r} ({exc})") from None
        return value

    @field_validator("override_generation_config")
    @classmethod
    def _overrides_known(cls, value: dict[str, float]) -> dict[str, float]:
        return {name: checked(name, v) for name, v in value.items()}

    @model_validator(mode="before")
    @classmethod
    def _model_by_name(cls, data: Any) -> Any:
        # A name (org/name[:quant]) becomes the local file or folder it names in the Hugging
        # Face cache, here, once: workers get a path. The served id defaults to the name.
        spec = data.get("model") if isinstance(data, dict) else None
        if not isinstance(spec, str) or not is_model_name(spec):
            return data
        from appliance.model.hub import resolve_model

        resolved = resolve_model(spec, data.get("revision") or None)
        served = data.get("served_model_name") or resolved.name
        return {**data, "model": resolved.path, "served_model_name": served}

    @field_validator("model")
    @classmethod
    def _model_exists(cls, value: Path | None) -> Path | None:
        if value is not None and not value.exists():
            raise ValueError(f"no such file or folder: {value}")
        return value

    @field_validator("weights", mode="before")
    @classmethod
    def _int4_is_quantized(cls, value: object) -> object:
        return "quantized" if value == "int4" else value

    @field_validator("prefill_devices", "decode_devices", "colocated_devices", mode="before")
    @classmethod
    def _read_device_list(cls, value: object) -> object:
        # Env, TOML and keywords give text like '0-1,3'; indices from code pass on as they are.
        return parse_devices(value) if isinstance(value, str) else value

    @field_validator("prefill_devices", "decode_devices", "colocated_devices")
    @classmethod
    def _one_form(cls, value: tuple[int, ...] | None) -> tuple[int, ...] | None:
        # Whatever the source, the partition gets sorted indices, each once; None is
        # automatic, () is 'none' (no device of this box: decode_devices with cluster.listen).
        return None if value is None else tuple(sorted(set(value)))

    @field_validator("api_key", mode="before")
    @classmethod
    def _empty_key_is_none(cls, value: object) -> object:
        return None if value == "" else value

    @model_validator(mode="after")
    def _graphs_can_run(self) -> Settings:
        # Only where the setting would otherwise be silently useless or fail every start.
        decoding_tp = self.prefill_tp if self.mode == "colocated" else self.decode_tp
        if self.batch.cuda_graphs and (self.device == "cpu" or decoding_tp > 1):
            why = (
                "device is cpu"
                if self.device == "cpu"
                else f"decoding workers span {decoding_tp} devices"
            )
            raise ValueError(f"batch.cuda_graphs needs one-device CUDA workers, but {why}")
        return self

    @model_validator(mode="after")
    def _colocated_beside_pools(self) -> Settings:
        if self.colocated_devices is None:
            return self
        if self.mode == "colocated":
            raise ValueError(
                "colocated_devices names colocated workers beside the prefill and decode "
                "pools (disaggregated mode); in colocated mode choose the devices with "
                "prefill_devices"
            )
        if self.prefill_tp > 1 or self.decode_tp > 1:
            raise ValueError(
                "colocated_devices runs one-device workers beside the pools: set prefill_tp "
                "and decode_tp to 1"
            )
        return self

    @model_validator(mode="after")
    def _groups_decode_in_their_box(self) -> Settings:
        if self.decode_devices == () and self.prefill_tp > 1:
            raise ValueError(
                "decode_devices=none leaves decoding to other boxes, but a tensor-parallel "
                "prefill group (prefill_tp > 1) hands KV off only within its own box: give "
                "this box a decode device, or set prefill_tp to 1"
            )
        return self

    @model_validator(mode="after")
    def _remote_needs_consent(self) -> Settings:
        if not self.allow_remote and not is_loopback(self.host):
            raise ValueError(
                f"host {self.host!r} is not a loopback address; set allow_remote "
                "(APPLIANCE_ALLOW_REMOTE=true) to serve other machines, ideally with an api_key"
            )
        return self

    def admin_token_path(self) -> Path:
        """The admin token file of the server on this port."""
        return self.admin.token_file or self.cache_dir / "admin" / f"{self.port}.token"

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The file is named by the `config` keyword (the --config flag): read only then.
        config = (
            init_settings.init_kwargs.get("config")
            if isinstance(init_settings, InitSettingsSource)
            else None
        )
        if config is None:
            return (init_settings, env_settings)
        return (init_settings, env_settings, TomlConfigSettingsSource(settings_cls, Path(config)))


def load_settings(config_file: Path | None = None, **overrides: Any) -> Settings:
    """Build the settings; raise SettingsError naming the first bad setting."""
    if config_file is not None and not config_file.is_file():
        raise SettingsError(f"config file not found: {config_file}")
    try:
        given: dict[str, Any] = {k: v for k, v in overrides.items() if v is not None}
        if config_file is not None:
            given["config"] = config_file
        return Settings(**given)
    except ValidationError as exc:
        raise SettingsError(_describe(exc)) from None
    except ValueError as exc:  # e.g. malformed TOML or env JSON
        raise SettingsError(f"invalid settings: {exc}") from None


def is_model_name(spec: str) -> bool:
    """Whether `spec` names a model of a hub (org/name, org/name:quant) rather than a local
    file or folder: it exists nowhere here and reads as a repository id."""
    if Path(spec).exists() or spec.lower().endswith((".gguf", ".safetensors")):
        return False
    return re.fullmatch(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*(:[\w.+-]+)?", spec) is not None


def parse_devices(text: str | None) -> tuple[int, ...] | None:
    """Device indices from '0,1', '0-3' or '0-1,3', sorted, each once; None when unset or
    blank (automatic). Raises ValueError saying what is wrong with the text."""
    if text is None or not text.strip():
        return None
    if text.strip().lower() == "none":  # a pool with no device on this box
        return ()
    indices: set[int] = set()
    for part in text.split(","):
        indices.update(_parse_part(part.strip()))
    return tuple(sorted(indices))


def _parse_part(part: str) -> range:
    match = re.fullmatch(r"(\d+)(?:\s*-\s*(\d+))?", part)
    if not match:
        raise ValueError("write device indices like '0,1' or '0-3'")
    low, high = int(match[1]), int(match[2] or match[1])
    if high < low:
        raise ValueError(f"range {part!r} runs backwards")
    return range(low, high + 1)


def is_loopback(host: str) -> bool:
    """Whether `host` only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost
        return False


def _describe(exc: ValidationError) -> str:
    lines = []
    for error in exc.errors():
        path = [str(part) for part in error["loc"]]
        if not path:  # a check across settings: its message names them
            lines.append(f"invalid settings: {error['msg'].removeprefix('Value error, ')}")
            continue
        env_name = "APPLIANCE_" + "__".join(p.upper() for p in path)
        value = error.get("input")
        lines.append(f"invalid setting {'.'.join(path)} ({env_name}={value!r}): {error['msg']}")
    return "; ".join(lines)
