"""Configuration of the trainer service (flags and MERIDIAN_TRAINER_* variables)."""
from __future__ import annotations

import dataclasses

from meridian import trajectory_transport as transport
from meridian.config import opt

STALE_MODES = ("drop", "downweight")
#: How ranks under torchrun hold the model (see services.trainer.distributed).
DATA_PARALLEL = ("ddp", "fsdp")
#: Attention kernels the learner may run (Hugging Face attn_implementation names).
ATTENTION = ("sdpa", "eager")
#: How per-token loss terms are aggregated (see services.trainer.loss).
AGGREGATIONS = ("token-mean", "seq-mean", "dr-grpo")
#: Where the learner computes (see services.trainer.learner.resolve_device).
DEVICES = ("auto", "cpu", "cuda")


def cpu_set(text: str) -> set[int]:
    """CPU ids from a list such as ``1`` or ``0-3,6`` (empty: none given)."""
    cpus: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        low, _, high = part.partition("-")
        try:
            first, last = int(low), int(high or low)
        except ValueError:
            raise ValueError(f"cpus must be a list of CPU ids and ranges such as '0-3,6', got {text!r}") from None
        if first < 0 or last < first:
            raise ValueError(f"cpus: bad range {part!r} in {text!r}")
        cpus.update(range(first, last + 1))
    return cpus


@dataclasses.dataclass
class TrainerConfig:
    model: str = opt("builtin", "Hugging Face model folder, or 'builtin' for SmolLM2-135M-Instruct")
    weightsync: str = opt("127.0.0.1:50054", "weightsync origin to publish versions to")
    signing_key: str = opt("", "Ed25519 private key (PKCS8 PEM) every published version is signed with; relays and rollouts given the public key refuse versions it did not sign (empty: versions go out unsigned)")
    redis_url: str = opt(transport.DEFAULT_URL, "Redis holding the trajectory stream")
    stream: str = opt(transport.DEFAULT_STREAM, "trajectory stream name")
    consumer_group: str = opt(transport.DEFAULT_CONSUMER_GROUP, "consumer group of this training job (rollouts measure their backlog against it)")
    consumer: str = opt("trainer-0", "this process's consumer name within the group")
    groups_per_step: int = opt(1, "complete GRPO groups per optimizer step")
    lr: float = opt(1e-6, "AdamW peak learning rate")
    warmup_steps: int = opt(0, "linear learning-rate warm-up steps, then constant (0: constant from the start)")
    weight_decay: float = opt(0.0, "AdamW decoupled weight decay")
    max_grad_norm: float = opt(1.0, "gradient clipping norm (0: off)")
    clip_low: float = opt(0.2, "lower ratio clip epsilon")
    clip_high: float = opt(0.28, "upper ratio clip epsilon")
    normalize_std: bool = opt(True, "divide group-relative advantages by the group's reward std")
    sample_std: bool = opt(False, "that std is the sample std (n - 1) instead of the population std (n)")
    loss_aggregation: str = opt("token-mean", "token-mean (DAPO), seq-mean (GRPO paper) or dr-grpo (constant divisor, no std scaling)")
    token_budget: int = opt(128, "dr-grpo's constant divisor per sequence: the generation budget in tokens (the rollout's max tokens)")
    drop_equal_reward_groups: bool = opt(True, "skip groups whose rewards are all equal (they carry no signal)")
    tis_cap: float = opt(2.0, "truncated importance sampling cap on pi_trainer / pi_behaviour per token (0: off, ratio against behaviour log-probs)")
    kl_coef: float = opt(0.0, "KL penalty to a frozen copy of the initial model (0: off, no reference model kept)")
    max_policy_lag: int = opt(4, "samples whose policy lags the trainer by more versions are stale")
    stale_mode: str = opt("drop", "what happens to stale samples: drop or downweight")
    stale_weight: float = opt(0.25, "loss weight of a stale sample in downweight mode")
    micro_batch: int = opt(8, "sequences per forward and backward pass; gradients accumulate over the batch (fewer: less memory; 0: the whole batch at once)")
    pack_prefix: bool = opt(True, "pack each micro-batch into one sequence with the rows' common prefix (a group's prompt) computed once; off: padded rows")
    pack_max_tokens: int = opt(4096, "packed positions per micro-batch at most (attention is quadratic in the packed length); a longer row is packed alone")
    autocast_bf16: bool = opt(False, "run forward and backward under bf16 autocast (master weights stay fp32)")
    attention: str = opt("sdpa", "attention kernel: sdpa (memory-efficient) or eager (plain matmuls: a faster backward on CPUs with bf16 matrix units, memory quadratic in a pack's length)")
    publish_every: int = opt(1, "publish every k optimizer steps")
    checkpoint_every: int = opt(10, "checkpoint every k publishing steps, in the background (groups are acked once a checkpoint covers them)")
    checkpoint_idle_s: float = opt(5.0, "checkpoint steps no checkpoint covers after this long without a step")
    checkpoint_dir: str = opt("", "folder for checkpoints; the trainer resumes from the newest complete one (empty: none, resume from weightsync's latest version without optimiser state)")
    keep_checkpoints: int = opt(2, "complete checkpoints kept on disk")
    claim_idle_ms: int = opt(60_000, "claim entries another consumer left pending this long (XAUTOCLAIM)")
    claim_every_s: float = opt(10.0, "seconds between claims of stale pending entries")
    dedupe_window: int = opt(1_000_000, "trained group ids remembered (in checkpoints) to drop redeliveries")
    data_parallel: str = opt("ddp", "under torchrun: ddp (every rank a full replica) or fsdp (FSDP2: parameters, gradients and optimiser state sharded over the ranks)")
    collective_timeout_s: float = opt(600.0, "under torchrun: seconds a rank waits for the others in a collective (of a step, a publish, a checkpoint read) and in the agreement after each phase; a rank failed or stuck mid-collective then makes every rank exit with the error within about twice this (no rank hangs), and a restart resumes from the checkpoint")
    device: str = opt("auto", "where the learner computes: auto (cuda where torch sees a GPU, else cpu), cpu or cuda; under torchrun each rank takes the GPU of its LOCAL_RANK and the ranks talk over NCCL (gloo on the CPU)")
    threads: int = opt(1, "torch CPU threads")
    cpus: str = opt("", "CPU ids the trainer process runs on, e.g. '1' or '2-7,12' (empty: wherever the OS puts it); keeps it off the cores an inference engine pins its threads to")
    seed: int = opt(0, "torch seed")

    def transport_config(self) -> transport.TransportConfig:
        return transport.TransportConfig(self.redis_url, self.stream, self.consumer_group)

    def __post_init__(self) -> None:
        cpu_set(self.cpus)  # rejects a malformed list at start-up
        if self.groups_per_step <= 0 or self.lr <= 0 or self.threads <= 0:
            raise ValueError("groups_per_step, lr and threads must be positive")
        if self.clip_low < 0 or self.clip_high < 0 or self.max_policy_lag < 0:
            raise ValueError("clip bounds and max_policy_lag must be >= 0")
        if self.loss_aggregation not in AGGREGATIONS:
            raise ValueError(f"loss_aggregation must be one of {AGGREGATIONS}, got {self.loss_aggregation!r}")
        if self.token_budget <= 0:
            raise ValueError(f"token_budget must be positive, got {self.token_budget}")
        if self.data_parallel not in DATA_PARALLEL:
            raise ValueError(f"data_parallel must be one of {DATA_PARALLEL}, got {self.data_parallel!r}")
        if self.stale_mode not in STALE_MODES:
            raise ValueError(f"stale_mode must be one of {STALE_MODES}, got {self.stale_mode!r}")
        if not 0 <= self.stale_weight <= 1:
            raise ValueError(f"stale_weight must be in [0, 1], got {self.stale_weight}")
        if self.tis_cap < 0 or self.kl_coef < 0 or self.warmup_steps < 0:
            raise ValueError("tis_cap, kl_coef and warmup_steps must be >= 0")
        if self.publish_every <= 0 or self.checkpoint_every <= 0 or self.keep_checkpoints <= 0 or self.dedupe_window <= 0:
            raise ValueError("publish_every, checkpoint_every, keep_checkpoints and dedupe_window must be positive")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.attention not in ATTENTION:
            raise ValueError(f"attention must be one of {ATTENTION}, got {self.attention!r}")
        if self.pack_max_tokens <= 0:
            raise ValueError(f"pack_max_tokens must be positive, got {self.pack_max_tokens}")
        if self.micro_batch < 0:
            raise ValueError(f"micro_batch must be >= 0, got {self.micro_batch}")
        if self.checkpoint_idle_s < 0:
            raise ValueError(f"checkpoint_idle_s must be >= 0, got {self.checkpoint_idle_s}")
        if self.collective_timeout_s <= 0:
            raise ValueError(f"collective_timeout_s must be positive, got {self.collective_timeout_s}")
        if self.claim_idle_ms <= 0 or self.claim_every_s <= 0:
            raise ValueError("claim_idle_ms and claim_every_s must be positive")
