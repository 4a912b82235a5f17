"""Configuration of the rollout service (flags and MERIDIAN_ROLLOUT_* variables)."""
from __future__ import annotations

import dataclasses
import math

from meridian import trajectory_transport as transport
from meridian.config import opt
from services.rollout.admission import AdmissionConfig
from services.rollout.engine import check_engine_cpus

#: Defaults of the request bounds, shared with the HTTP app's own defaults.
DEFAULT_MAX_PROMPT_BYTES = 1 << 20
DEFAULT_HTTP_MAX_BODY_BYTES = 4 << 20


@dataclasses.dataclass
class RolloutConfig:
    model: str = opt("builtin", "Hugging Face model folder, or 'builtin' for SmolLM2-135M-Instruct")
    region: str = opt("", "this rollout's region, written into every trajectory it samples (empty: unnamed)")
    envsandbox: str = opt("127.0.0.1:50052", "envsandbox address")
    sandbox_lease_s: float = opt(30.0, "lease of the sandboxes an episode holds, renewed every third of it while this process lives: a rollout killed mid-episode leaves its sandboxes open this long (0: no lease; they live to envsandbox's time-to-live)")
    weightsync: str = opt("", "weightsync address to take new policy versions from (empty: none)")
    verify_key: str = opt("", "Ed25519 public key (PEM) policy versions must be signed with: a version it did not sign is refused before it is applied, and the served version stays (empty: no check)")
    redis_url: str = opt(transport.DEFAULT_URL, "Redis holding the trajectory stream")
    stream: str = opt(transport.DEFAULT_STREAM, "trajectory stream name")
    consumer_group: str = opt(transport.DEFAULT_CONSUMER_GROUP, "the trainer's consumer group, whose backlog the RL workers watch")
    group_size: int = opt(4, "samples per task (GRPO group) when a request asks for none")
    max_tokens: int = opt(128, "generated tokens per sample when a request asks for none")
    temperature: float = opt(1.0, "RL sampling temperature when a request gives none")
    max_model_len: int = opt(2048, "longest prompt + completion, tokens")
    kv_cache_gib: float = opt(1.0, "CPU KV cache size, GiB")
    seed: int = opt(0, "engine seed")
    engine_cpus: str = opt("auto", "CPUs the engine's worker threads are bound to: 'auto' (vLLM's binding: one NUMA node's cores but one, the same for every engine on a host), 'none' (unbound: one OpenMP thread per CPU this process may use), or a CPU list such as '0-3,8' (engines sharing a host: a list of their own each)")
    update_policy: str = opt("finish", "requests in flight during a weight update: 'finish' on the old weights, or 'pause' and continue on the new")
    weight_apply: str = opt("delta", "how a version reaches the engine: 'delta' (changed elements, in place; 'full' when the engine's loader cannot be followed element-wise) or 'full' (every tensor through vLLM's reload)")
    canary_mean_tolerance: float = opt(0.15, "reject a version whose canary log-probs differ from the trainer's by more than this many nats per token on average")
    canary_max_tolerance: float = opt(1.5, "... or by more than this many nats on any single token")
    http_host: str = opt("127.0.0.1", "OpenAI-compatible HTTP API address")
    http_port: int = opt(-1, "OpenAI-compatible HTTP API port (0: a free port; -1: off)")
    rl_workers: int = opt(0, "background RL episode workers filling spare capacity (0: only on-demand RunEpisodes)")
    rl_high_water: int = opt(500, "RL workers pause while the trajectory stream holds more unconsumed groups than this")
    rl_max_lag: int = opt(2, "RL workers pause while this rollout lags the newest published version by more (the trainer's max_policy_lag is what it drops)")
    rl_quiet_ms: float = opt(200.0, "RL runs at --rl-max-concurrency only after production traffic has been quiet this long")
    rl_max_concurrency: int = opt(16, "RL requests running at once while production is quiet (the controller's ceiling)")
    slo_ttft_ms: float = opt(1000.0, "production time-to-first-token target of the RL admission controller")
    slo_itl_ms: float = opt(100.0, "production inter-token latency target of the RL admission controller")
    slo_window_ms: float = opt(1000.0, "controller window: RL concurrency beside production grows by one after a window that met the targets")
    rl_decrease: float = opt(0.5, "factor on that RL concurrency at a missed target (at most once per window)")
    rl_preempt: bool = opt(True, "preempt running RL requests above the limit (resumed later from their tokens); false: the limit only stops new ones")
    caller_classes: str = opt("", "JSON file mapping API keys (Authorization: Bearer <key>, HTTP and gRPC) to a traffic class, production or rl")
    anonymous_class: str = opt("production", "traffic class of callers with no key: production, rl, or deny")
    max_n: int = opt(8, "most completions one OpenAI API request may ask for (n)")
    max_prompt_bytes: int = opt(DEFAULT_MAX_PROMPT_BYTES, "prompt text (UTF-8 bytes; chat: all message contents) a Generate or OpenAI API request may carry; checked before tokenising, more answers INVALID_ARGUMENT / HTTP 413")
    http_max_body_bytes: int = opt(DEFAULT_HTTP_MAX_BODY_BYTES, "largest OpenAI API request body, bytes; a larger one answers HTTP 413 before it is read whole")
    http_max_concurrency: int = opt(256, "OpenAI API connections and requests in flight at once (each may buffer a body); more answer HTTP 503")
    max_turns: int = opt(4, "model turns per episode")
    episode_wall_s: float = opt(300.0, "wall-clock limit of one episode")
    sandbox_budget: int = opt(256, "envsandbox sandboxes this rollout's episodes hold at once at most (a group holds group size + 1 from its Create to its last Close); groups past it wait their turn, so a RunEpisodes asking for more runs in waves instead of failing. Lowered to envsandbox's own --max-sandboxes where that is smaller (read from envsandbox); several rollouts may share one envsandbox, whose line orders their groups (see sandbox_wait_s)")
    sandbox_wait_s: float = opt(300.0, "how long a group's first Create may wait in envsandbox's line when envsandbox is full (other rollouts sharing it hold its sandboxes); 0: fail at once. Within envsandbox's --max-create-wait-s")

    def admission_config(self) -> AdmissionConfig:
        """The RL admission controller's settings."""
        return AdmissionConfig(
            ttft_s=self.slo_ttft_ms / 1000,
            itl_s=self.slo_itl_ms / 1000,
            window_s=self.slo_window_ms / 1000,
            max_rl=self.rl_max_concurrency,
            decrease=self.rl_decrease,
            quiet_s=self.rl_quiet_ms / 1000,
            preempt=self.rl_preempt,
        )

    def transport_config(self) -> transport.TransportConfig:
        return transport.TransportConfig(self.redis_url, self.stream, self.consumer_group)

    def __post_init__(self) -> None:
        if self.group_size <= 0 or self.max_tokens <= 0 or self.max_model_len <= 0:
            raise ValueError("group_size, max_tokens and max_model_len must be positive")
        if not (math.isfinite(self.sandbox_lease_s) and self.sandbox_lease_s >= 0):
            raise ValueError(f"sandbox_lease_s must be a finite number >= 0 (0: no lease), got {self.sandbox_lease_s}")
        if self.kv_cache_gib <= 0:
            raise ValueError("kv_cache_gib must be positive")
        check_engine_cpus(self.engine_cpus)
        if self.weight_apply not in ("delta", "full"):
            raise ValueError(f"weight_apply must be delta or full, got {self.weight_apply!r}")
        if not (self.canary_mean_tolerance > 0 and self.canary_max_tolerance > 0):
            raise ValueError("canary tolerances must be positive")
        if self.update_policy not in ("finish", "pause"):
            raise ValueError(f"update_policy must be finish or pause, got {self.update_policy!r}")
        if self.http_port < -1 or self.http_port > 65535:
            raise ValueError(f"http_port must be -1 (off), 0 (free port) or a port, got {self.http_port}")
        if self.rl_quiet_ms < 0:
            raise ValueError(f"rl_quiet_ms must be >= 0, got {self.rl_quiet_ms}")
        self.admission_config()  # validates the controller's settings
        if self.anonymous_class not in ("production", "rl", "deny"):
            raise ValueError(f"anonymous_class must be production, rl or deny, got {self.anonymous_class!r}")
        if self.max_n < 1:
            raise ValueError(f"max_n must be >= 1, got {self.max_n}")
        if self.max_prompt_bytes < 1 or self.http_max_body_bytes < 1 or self.http_max_concurrency < 1:
            raise ValueError("max_prompt_bytes, http_max_body_bytes and http_max_concurrency must be >= 1")
        if not 0 <= self.sandbox_wait_s < float("inf"):
            raise ValueError(f"sandbox_wait_s must be finite and >= 0, got {self.sandbox_wait_s}")
        if self.sandbox_budget < self.group_size + 1:
            raise ValueError(f"sandbox_budget must hold one group: at least group_size + 1 = {self.group_size + 1}, got {self.sandbox_budget}")
        if self.rl_workers < 0 or self.rl_high_water <= 0 or self.rl_max_lag < 0 or self.max_turns <= 0 or self.episode_wall_s <= 0:
            raise ValueError("rl_workers and rl_max_lag must be >= 0; rl_high_water, max_turns, episode_wall_s > 0")
