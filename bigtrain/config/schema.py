"""Typed configuration: one dataclass per component, a docstring per field.

Each docstring says what the field does and when it takes effect. Runtime objects never live here:
the config is plain data that OmegaConf merges from YAML files and `key=value` overrides.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bigtrain.config.data import DataConfig
from bigtrain.config.drills import DrillConfig
from bigtrain.config.eval import EvalConfig
from bigtrain.config.fault_tolerance import FaultToleranceConfig
from bigtrain.config.model import ModelConfig, default_d_ff
from bigtrain.config.parallel import ParallelConfig
from bigtrain.config.resilience import MonitorConfig, ResilienceConfig
from bigtrain.config.telemetry import LogConfig, ProfileConfig


@dataclass
class PrecisionPhase:
    until: float = 1.0
    """This phase lasts until this fraction of train.max_steps (phases are in order)."""
    compute_dtype: str = "bf16"
    """Compute dtype of the phase: `bf16`, `fp16` or `fp32`."""
    fp32_modules: list[str] = field(default_factory=list)
    """Module name patterns kept entirely in FP32 during the phase (added to precision.fp32_modules)."""
    fp8: bool | None = None
    """FP8 layers on (true) or in BF16 (false) during the phase; None: as precision.fp8.enabled.
    Needs precision.fp8 on (the layers are converted once, at build)."""


@dataclass
class Int8Config:
    enabled: bool = False
    """Run the forward matmuls of the selected linear layers in INT8 (weights per output channel,
    activations per token); gradients in the compute dtype against the FP32 master weights
    (straight-through estimator). Applied when the model is built, before sharding."""
    modules: list[str] = field(default_factory=lambda: ["*"])
    """Name patterns (fnmatch on canonical names) of the linear layers (`nn.Linear`, GPT-2's
    `Conv1D`) to convert. Other module types never convert."""
    exclude: list[str] = field(
        default_factory=lambda: [
            "*attn.proj",
            "*attn.c_proj",
            "*self_attn.o_proj",
            "*lm_head",
            "*norm*",
            "*emb*",
            "*wte",
            "*wpe",
        ]
    )
    """Patterns kept in the compute dtype even when `modules` selects them. Default: the attention
    output projection (bigtrain's GPT, GPT-2, Llama names), norms, embeddings and `lm_head`."""
    weight_scheme: str = "symmetric"
    """Weight quantization: `symmetric` per output channel (the only scheme)."""
    activation_scheme: str = "affine"
    """Activation quantization per token: `affine` (scale and zero point, the range holds 0) or
    `symmetric` (scale only)."""
    calibration_steps: int = 20
    """Optimizer steps over which each layer records the max |x| per input channel (a MAX across
    ranks); then the SmoothQuant scales start. 0: no smoothing, per-token scales only."""
    calibration: str = "fixed"
    """After calibration: `fixed` scales, or `ema` (keep following the activations)."""
    ema_decay: float = 0.99
    """calibration=ema: weight of the old max |x| in each step's update."""
    smoothing_alpha: float = 0.5
    """SmoothQuant migration strength in (0, 1]: s = amax(x)^a / amax(W)^(1-a) per channel."""


@dataclass
class Fp8Config:
    enabled: bool | None = None
    """FP8 matmuls (torchao's Float8Linear, dynamic scaling) for the selected linear layers,
    forward and backward, against FP32 master weights; needs BF16 compute. None: auto, on only
    where it pays (a GPU with FP8 tensor cores, CUDA capability >= 8.9, and a model of at least
    1B parameters; docs/precision.md); off on CPU unless set to true. Needs torchao
    (`pip install 'bigtrain[fp8]'`)."""
    recipe: str = "tensorwise"
    """torchao's scaling recipe: `tensorwise` (one scale per tensor; FP8 all-gather),
    `rowwise` (a scale per row, power-of-two scales) or `rowwise_with_gw_hp` (rowwise, the
    weight gradient in high precision)."""
    modules: list[str] = field(default_factory=lambda: ["*"])
    """Name patterns (fnmatch on canonical names) of the `nn.Linear` layers to convert."""
    exclude: list[str] = field(default_factory=lambda: ["*lm_head", "*emb*", "*wte", "*wpe"])
    """Patterns kept in BF16 even when `modules` selects them. Besides these, MoE routers (the
    linear layer beside an `experts` module), batched expert weights and layers whose dimensions
    FP8 kernels cannot take (not multiples of 16) are excluded automatically, each with its
    reason in the policy table."""
    all_gather: bool | None = None
    """FSDP2 all-gathers the FP8 layers' weights in FP8 (half BF16's bytes), with the scales
    precomputed once per step for all layers. None: on with parallel.backend=fsdp and the
    tensorwise recipe (the only recipe torchao gathers in FP8)."""
    emulate: bool = False
    """Emulate the FP8 matmuls in high precision (tests on hardware without `torch._scaled_mm`)."""
    check_every: int = 50
    """Every this many steps each FP8 layer's result is compared with its BF16 result on the
    step's first micro-batch (one extra forward of the FP8 layers); 0: never."""
    max_error: float = 0.25
    """The sampled relative error ||y_fp8 - y_bf16|| / ||y_bf16|| above which a check counts
    against a layer (healthy FP8 layers measure ~0.03-0.08; docs/precision.md)."""
    max_underflow: float = 0.1
    """The share of a layer's nonzero inputs that FP8 flushes to zero above which a check also
    counts against it (healthy layers measure < 0.001: an outlier that sets the scale flushes
    the rest, and the model may learn around the loss, lowering the error but not this)."""
    patience: int = 2
    """Consecutive failed checks (error above max_error or underflow above max_underflow) after
    which the layer goes back to BF16 for the rest of the run."""
    fallback: bool = True
    """Move a layer whose checks fail, or whose FP8 cast turned finite inputs non-finite, to BF16
    by itself (an `fp8_fallback` event). False: the events only."""


@dataclass
class PrecisionConfig:
    preset: str = "auto"
    """`auto` chooses from the hardware and model size; `fp32`, `bf16-mixed`, `fp16-mixed` fix the
    compute dtype (and loss scaling). Explicit keys below override the preset. Resolved once at
    start and printed with a reason per line."""
    compute_dtype: str = "auto"
    """Dtype of the matmuls: `auto`, `bf16`, `fp16` (needs loss scaling) or `fp32`."""
    master_dtype: str = "fp32"
    """Dtype of the parameters the optimizer updates. Only `fp32` is valid: low-precision master
    weights lose small updates."""
    optimizer_state_dtype: str = "fp32"
    """Dtype Adam's moments are stored in: `fp32`, `bf16` (stochastic rounding) or `fp16`
    (per-tensor scaling). Math is FP32 either way (bigtrain's AdamW)."""
    optimizer_state_rounding: str = "stochastic"
    """BF16 states: `stochastic` (unbiased) or `nearest` (stalls on small updates; for studies)."""
    optimizer_state_scaling: str = "per_tensor"
    """FP16 states: `per_tensor` power-of-two scaling. `none` is refused (the second moment
    underflows in FP16 without it)."""
    loss_scaling: str = "auto"
    """`auto` (dynamic with fp16 compute, none otherwise), `dynamic`, `static` or `none`."""
    loss_scale: float = 65536.0
    """Initial (dynamic) or fixed (static) loss scale."""
    loss_scale_growth_interval: int = 2000
    """Dynamic: double the scale after this many steps without overflow."""
    loss_scale_hysteresis: int = 2
    """Dynamic: every N-th overflow halves the scale (1: each one); every overflow skips its step.
    The count restarts after a halving or a growth."""
    loss_scale_min: float = 1.0
    """Dynamic: an overflow at this scale is an anomaly, not another halving."""
    allow_bf16_loss_scaling: bool = False
    """Loss scaling with BF16 compute is almost always a mistake (BF16 has FP32's range); set this
    to ask for it anyway."""
    fp32_softmax: bool | None = None
    """Compute the attention softmax in FP32 through the explicit attention path. None: auto
    (on for models of 7B parameters and more)."""
    fp32_modules: list[str] = field(default_factory=list)
    """Module name patterns (fnmatch, e.g. `lm_head`, `*.attn.q`) kept entirely in FP32."""
    allow_tf32: bool = True
    """Allow TF32 for FP32 matmuls on CUDA (sm80+)."""
    adaptive_clip: bool | None = None
    """Clip at a running percentile of recent healthy gradient norms instead of optim.grad_clip.
    None: auto (on from 20B parameters)."""
    adaptive_clip_percentile: float = 95.0
    """Percentile of the last `adaptive_clip_window` healthy gradient norms used as the clip value."""
    adaptive_clip_window: int = 100
    """Healthy steps remembered by adaptive clipping."""
    int8: Int8Config = field(default_factory=Int8Config)
    """INT8 forward for linear layers (see Int8Config)."""
    fp8: Fp8Config = field(default_factory=Fp8Config)
    """FP8 matmuls for linear layers (see Fp8Config)."""
    schedule: list[PrecisionPhase] = field(default_factory=list)
    """Phases by fraction of the run, e.g. FP32 for the first 5%, BF16 to 99%, BF16 with chosen
    modules in FP32 for the rest. Empty: the resolved compute dtype throughout."""


@dataclass
class OptimConfig:
    lr: float = 1e-3
    """Peak learning rate, reached at the end of warmup."""
    min_lr_ratio: float = 0.1
    """The schedule decays to lr x min_lr_ratio at max_steps."""
    schedule: str = "cosine"
    """`cosine`, `linear` or `constant` after the warmup."""
    warmup_steps: int = 20
    """Linear warmup from 0 over this many optimizer steps."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to matrices only (not to biases, norms)."""
    beta1: float = 0.9
    """Adam beta1."""
    beta2: float = 0.95
    """Adam beta2."""
    eps: float = 1e-8
    """Adam epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping (the norm is still logged)."""
    fused: bool | None = None
    """One fused kernel for the whole update instead of multi-tensor ops. FP32 states: torch's
    fused AdamW instead of its foreach one. BF16/FP16 states: bigtrain's Triton kernel (needs CUDA
    and Triton) instead of decoding around torch's fused AdamW. None: on CUDA. At setup."""


@dataclass
class TrainConfig:
    out_dir: str = "runs/tiny"
    """Run directory: config, metrics, events, checkpoints, wandb. One live run at a time: rank 0
    locks it (`RUN_DIR/.lock`) at setup; a second run on it exits 2."""
    lock_timeout_s: float = 120.0
    """A run directory's lock held by another host counts as abandoned once its heartbeat (every
    min(this / 4, 30) s) is this old; a lock on this host whose process is gone is taken over at
    once. At setup."""
    max_steps: int = 300
    """Optimizer steps of the whole run; the LR schedule spans them. May change on resume."""
    stop_at_step: int | None = None
    """End this process after this step with a committed checkpoint (a `stop` event, exit 0, no
    final.json), without ending the run: `resume=auto` goes on from there. For time-boxed jobs."""
    seed: int = 1337
    """Seeds the model init and the data order (a pure function of seed and sample index)."""
    micro_batch_size: int = 16
    """Sequences per rank per forward/backward."""
    grad_accum_steps: int = 1
    """Micro-batches accumulated per optimizer step. Global batch = micro x accum x world size.
    Derived from `global_batch_size` when that is set."""
    global_batch_size: int | None = None
    """Sequences per optimizer step over all ranks. When set, grad_accum_steps = global batch /
    (micro_batch_size x world size), derived at setup (exit 2 when it does not divide): the same
    config then runs at any world size, and a run saved on 2 ranks resumes on 1 or 4 unchanged.
    None: micro_batch_size x grad_accum_steps x world size."""
    log_every: int = 10
    """Write a metrics line (and sync loss to the host) every N steps, and at the last step."""
    eval_every: int = 100
    """Validation loss every N steps and at the last step; 0 disables."""
    eval_batches: int = 8
    """Micro-batches of validation data per evaluation (the same sequences every time)."""
    device: str = "auto"
    """`auto` (cuda if available, else cpu), `cpu` or `cuda`."""
    progress: bool = True
    """Rank 0's progress: a bar with loss, tokens/s and MFU when stderr is a terminal, else one
    line per logged step with elapsed time and ETA (docs/observability.md, The console). Events
    are printed either way."""
    num_threads: int = 0
    """torch intra-op threads on CPU; 0 keeps torch's default."""
    peak_flops: float | None = None
    """Peak FLOP/s of one device for MFU. None: the data-sheet peak of known GPUs (V100, A100,
    H100, H200) in the compute dtype, or on a CPU a matmul measured by the first run on the
    machine and kept in the cache root (cpu_peak_flops.json beside the token caches; delete it
    to measure again)."""


@dataclass
class CheckpointConfig:
    every: int = 100
    """Save every N optimizer steps and at the last step; 0 saves only at the end; -1 never
    (benchmarks; a preemption still checkpoints)."""
    keep: int = 3
    """Committed checkpoints kept; older ones are deleted after a new one commits."""
    resume: str = "auto"
    """`auto`: the newest checkpoint under out_dir whose manifest verifies (older on failure);
    `never`: start fresh (refused if out_dir already holds checkpoints); or a checkpoint path."""
    allow_config_change: bool = False
    """On resume, accept a changed model setting, tokenizer/corpus or global batch (never a
    changed parameter shape). Every changed key is listed in the `resume` event either way."""
    async_save: bool = True
    """Write checkpoints in the background: the state is copied to host memory (or taken from
    this step's rollback snapshot), training goes on while a writer thread writes (DCP, every
    backend), hashes and fsyncs the files, and the commit follows at a later step once every
    rank finished. The last step's and a preemption's checkpoints are always synchronous."""
    verify_finite: bool = True
    """Before writing, check that master weights and optimizer states are finite on every rank;
    a non-finite state is never checkpointed (a `checkpoint_refused` event instead)."""


@dataclass
class WandbConfig:
    mode: str = "offline"
    """`online`, `offline` (files under out_dir/wandb) or `disabled`."""
    project: str = "bigtrain"
    """wandb project."""
    entity: str | None = None
    """wandb entity (team or user); None uses the default."""
    name: str | None = None
    """Run name; None: the run directory's name."""
    group: str | None = None
    """Run group."""
    tags: list[str] = field(default_factory=list)
    """Run tags."""
    notes: str | None = None
    """Run notes (a description shown on the wandb run page)."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    """The architecture (bigtrain's GPT or a transformers model) and where its weights start."""
    data: DataConfig = field(default_factory=DataConfig)
    """The corpus, its tokenizer and the data order."""
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    """The dtype of each component, loss scaling, FP32 islands, INT8 layers."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """AdamW, the learning-rate schedule and gradient clipping."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The run: its directory, length, batch, logging and evaluation."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Samples generated during training."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """When checkpoints are written and kept, and what a restart resumes."""
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    """The gradient statistics of every step and the rules that call a step anomalous."""
    resilience: ResilienceConfig = field(default_factory=ResilienceConfig)
    """What an anomaly does: replay, rollback targets, the ladder, the hang watchdog."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """The backend (local, FSDP2, ZeRO) and the mesh."""
    log: LogConfig = field(default_factory=LogConfig)
    """Where metrics, events and the run's figures go besides metrics.jsonl: wandb, TensorBoard,
    MLflow."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """The wandb sink's settings (log.sinks names the sinks)."""
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    """Profiler traces of chosen steps and CUDA memory snapshots; off by default."""
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    """Replica groups that fail and rejoin alone (torchft); off by default."""
    drill: DrillConfig = field(default_factory=DrillConfig)
    """Faults injected on purpose, for drills and tests; off by default."""


__all__ = [
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "EvalConfig",
    "DrillConfig",
    "FaultToleranceConfig",
    "LogConfig",
    "ModelConfig",
    "MonitorConfig",
    "OptimConfig",
    "ParallelConfig",
    "PrecisionConfig",
    "ProfileConfig",
    "ResilienceConfig",
    "TrainConfig",
    "WandbConfig",
    "default_d_ff",
]
