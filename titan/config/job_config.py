"""The configuration tree: one dataclass per TOML section.

Every field has a type (fixed string choices are the Literal types of choices.py), a default and
a docstring (the string literal right under it). CLI flags, ``--help`` and docs/config_reference.md
are generated from these classes, so this file is the only list of options.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from titan.config.choices import (ACMode, AsyncMode, AttnType, BadLines, CheckpointPart, CompileComponent,
    ConfigMismatch, DecayType, DType, Float8Recipe, MixedPrecisionDType, NonFinite, OnSaveError, OptimizerImplementation,
    ReshardAfterForward, RotateMethod, TxtSplit, WeightDecayExclude)


@dataclass
class Job:
    config_file: str = ""
    """TOML file to load; CLI flags override its values. `--config_file` is accepted too."""
    dump_folder: str = "./outputs"
    """Root folder for everything a run writes (TensorBoard logs, checkpoints, traces)."""
    description: str = "titan training job"
    """Free-text description of the job, printed at start-up."""
    print_config: bool = False
    """Print the merged configuration (defaults <- TOML <- CLI) at start-up."""
    dry_run: bool = False
    """Check the layout without hardware: one CPU process on a fake process group builds the real
    mesh and the parallelized model on the meta device for `dry_run_world_size` ranks, then prints
    the plan and per-rank parameters and memory (run_train.sh: COMM_MODE=fake_backend, NGPU ranks)."""
    dry_run_world_size: int = 8
    """Number of ranks the dry run simulates (e.g. 512 for 64 nodes of 8 GPUs)."""
    debug: bool = False
    """Show the Python traceback of a titan error instead of its one-line message (so does the
    TITAN_DEBUG environment variable)."""
    overwrite: bool = False
    """Allow replacing checkpoints: start from scratch when the checkpoint folder holds an earlier
    run's checkpoints (they are deleted), or resume from an older checkpoint.load_step (the later
    ones are replaced). Without it titan resumes or stops with an error, never deletes."""


@dataclass
class Model:
    name: str = "llama3"
    """Model family from the registry in titan/models (currently: llama3)."""
    flavor: str = "debugmodel"
    """Model size: debugmodel, 8B, 70B, 405B."""
    tokenizer_path: str = ""
    """Tokenizer file (tiktoken `tokenizer.model`, sentencepiece `.model` or HF `tokenizer.json`).
    Empty: the small tokenizer shipped in titan/data/assets."""
    attn_type: AttnType = "sdpa"
    """Attention backend: sdpa (torch scaled_dot_product_attention) or flex (flex_attention with a
    causal block mask; CUDA only for training, as torch's flex_attention has no CPU backward)."""
    n_layers: int | None = None
    """Override the flavor's number of transformer blocks (unset: the flavor's value), e.g. the 8B
    shape cut to 8 layers to fit one GPU for benchmarking and debugging."""
    dim: int | None = None
    """Override the flavor's model width (unset: the flavor's value); must be divisible by n_heads."""
    n_heads: int | None = None
    """Override the flavor's number of query heads (unset: the flavor's value)."""
    n_kv_heads: int | None = None
    """Override the flavor's number of key/value heads (unset: the flavor's value); must divide n_heads."""
    depth_init: bool = True
    """Init std of the residual-stream output projections (wo, w2, w3). true: depth-scaled per
    block, 0.02 / sqrt(2 * (layer_id + 1)) (early blocks larger, as in torchtitan); false: one
    factor for all blocks, 0.02 / sqrt(2 * n_layers) (GPT-2 / Megatron style)."""


@dataclass
class Optimizer:
    name: str = "AdamW"
    """Optimizer: AdamW or Adam."""
    lr: float = 8e-4
    """Peak learning rate (reached at the end of warmup)."""
    beta1: float = 0.9
    """Adam beta1."""
    beta2: float = 0.95
    """Adam beta2."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay."""
    implementation: OptimizerImplementation = "foreach"
    """Kernel choice: for-loop, foreach or fused (fused needs a device that supports it). Not
    used with bf16_stochastic_round, whose torchao kernel is compiled per parameter."""
    weight_decay_exclude: list[WeightDecayExclude] = field(default_factory=list)
    """Parameter kinds that get no weight decay (a second param group): any of "norms" (weights
    of *Norm modules), "embeddings" (nn.Embedding weights, and a tied output). Empty: decay all."""
    bf16_stochastic_round: bool = False
    """Keep parameters in bfloat16 and update them with torchao's AdamW, which computes in fp32
    and rounds the new weights to bf16 stochastically (unbiased, so small updates are not lost).
    Needs name = AdamW; compute then runs in bf16."""


@dataclass
class LRScheduler:
    warmup_steps: int = 200
    """Linear warmup steps from ~0 to the peak lr."""
    decay_ratio: float | None = None
    """Fraction of steps spent decaying at the end (WSD: warmup, stable, decay). None: decay over
    all steps after warmup."""
    decay_type: DecayType = "linear"
    """Shape of the decay: linear, sqrt or cosine."""
    min_lr_factor: float = 0.0
    """Final lr as a fraction of the peak lr."""


@dataclass
class Training:
    dataset: str = "pydoc"
    """Dataset name from the registry (pydoc: the embedded offline corpus, c4, c4_validation) or
    a local path when `dataset_path` is set."""
    dataset_path: str = ""
    """Local file or folder (jsonl/json/parquet/arrow/txt) to read instead of the hub source; for
    c4, a mirror in allenai/c4's layout (en/c4-train.*.json.gz, docs/datasets.md)."""
    dataset_text_field: str = "text"
    """Column that holds the document text in local / hub datasets."""
    dataset_txt_split: TxtSplit = "paragraph"
    """How .txt files are cut into documents: paragraph (at blank lines), line, or document
    (one document per file)."""
    local_batch_size: int = 8
    """Sequences per micro-batch on each data-parallel rank."""
    global_batch_size: int = -1
    """Sequences per optimizer step over all data-parallel ranks. -1: local_batch_size x dp.
    A larger multiple means gradient accumulation."""
    seq_len: int = 2048
    """Tokens per sequence."""
    steps: int = 10000
    """Optimizer steps to train for."""
    max_norm: float = 1.0
    """Gradient-norm clipping threshold (total L2 norm over all parameters). <= 0 disables it."""
    seed: int | None = None
    """Seed for weight init and RNG. None: a fixed default of 0 is used so runs are repeatable."""
    deterministic: bool = False
    """Bitwise-repeatable runs (slower): deterministic algorithms, fixed cuBLAS workspace, no cuDNN
    attention, Inductor without numerics-changing autotuning; see docs/stability.md."""
    mixed_precision_param: MixedPrecisionDType = "bfloat16"
    """FSDP parameter dtype in forward/backward: bfloat16 or float32 (on CPU bfloat16 matmuls are
    very slow; use float32 there)."""
    mixed_precision_reduce: MixedPrecisionDType = "float32"
    """FSDP gradient reduce dtype: float32 or bfloat16."""
    dataset_infinite: bool = True
    """Re-loop over the dataset when it ends (logged, with an epoch counter). False: training
    stops cleanly when the data runs out."""
    dataset_bad_lines: BadLines = "fail"
    """A .jsonl line that is not a JSON object or not UTF-8: "fail" (stop naming file:line) or
    "skip" (drop it, log a count and the first few file:line)."""
    dataloader_num_workers: int = 0
    """Worker processes that prefetch batches (0: load in the training process)."""
    gc_freq: int = 50
    """Run Python's garbage collector every N steps (automatic gc is disabled to avoid stalls)."""
    nonfinite: NonFinite = "stop"
    """What a NaN/inf loss or grad norm does (checked every step, before the optimizer step):
    stop (raise and exit non-zero naming the step and metric, saving nothing) or skip_step (no
    optimizer update for that step; the step counter, data and LR schedule still advance)."""
    nonfinite_max_consecutive_skips: int = 10
    """With nonfinite = skip_step: stop once this many steps in a row were skipped."""


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = 1
    """Replicas of the model (DDP, or HSDP together with data_parallel_shard_degree)."""
    data_parallel_shard_degree: int = -1
    """FSDP shard group size. -1: the ranks left over by the other degrees."""
    fsdp_reshard_after_forward: ReshardAfterForward = "default"
    """Free gathered parameters after forward: default (yes, except the root module), always,
    never."""
    tensor_parallel_degree: int = 1
    """Tensor (+ sequence) parallel degree: each block's matmuls are split over this many ranks.
    Must divide model n_heads and n_kv_heads."""
    disable_loss_parallel: bool = False
    """With TP, gather the full logits before the loss instead of computing cross entropy on
    vocab-sharded logits (loss parallel, the default, saves the gather and its memory)."""
    enable_async_tensor_parallel: bool = False
    """Overlap TP collectives with matmuls (symmetric memory; CUDA only, takes effect in
    compiled blocks)."""
    pipeline_parallel_degree: int = 1
    """Pipeline stages' rank groups: the layers are split into stages over this many ranks."""
    pipeline_parallel_schedule: str = "1F1B"
    """torch.distributed.pipelining schedule by name: GPipe, 1F1B, Interleaved1F1B, LoopedBFS,
    InterleavedZeroBubble, ZBVZeroBubble, DualPipeV. Looped/interleaved/ZB-V schedules run
    several stages per rank."""
    pipeline_parallel_schedule_csv: str = ""
    """CSV file describing a custom schedule (torch's _PipelineScheduleRuntime format); when
    set it replaces pipeline_parallel_schedule."""
    pipeline_parallel_microbatch_size: int = 1
    """Sequences per pipeline micro-batch; local_batch_size must be a multiple of it."""
    pipeline_parallel_layers_per_stage: int = -1
    """Transformer layers per pipeline stage. -1: one stage per rank for single-stage schedules,
    two per rank for multi-stage ones, layers spread as evenly as possible (a remainder goes to
    the middle stages first, never to the last one, which holds the output and loss)."""
    context_parallel_degree: int = 1
    """Context parallel degree: each sequence is split over this many ranks (ring attention).
    training.seq_len must be divisible by 2 x this degree (head-tail load balancing)."""
    context_parallel_rotate_method: RotateMethod = "allgather"
    """How context-parallel ranks exchange key/value shards: allgather or alltoall."""


@dataclass
class Metrics:
    log_freq: int = 10
    """Log one console line (and TensorBoard scalars) every N steps."""
    param_norm_freq: int = 10
    """Add param_norm (total L2 norm of the weights entering the step) to the log of step 1 and of
    every log step that is a multiple of N. It reads every weight once, so log_freq = 1 runs pay for
    it only every N steps. 0: never."""
    enable_tensorboard: bool = False
    """Write TensorBoard event files."""
    save_tb_folder: str = "tb"
    """TensorBoard folder, relative to job.dump_folder."""
    disable_color_printing: bool = False
    """Plain console output without ANSI colors. Colors are used only when the output is a
    terminal and NO_COLOR is not set, so logs written to a file or pipe are plain anyway."""
    log_rank: int = 0
    """Rank that prints the metrics line and writes TensorBoard / JSONL / W&B. -1: every rank
    (files get a rank suffix)."""
    enable_jsonl: bool = True
    """Append every logged step's scalars as one JSON line to <dump_folder>/<save_jsonl_folder>/
    <run stamp>.jsonl (plot with scripts/plot_metrics.py)."""
    save_jsonl_folder: str = "metrics"
    """JSONL metrics folder, relative to job.dump_folder."""
    enable_wandb: bool = False
    """Log to Weights & Biases (pip install 'titan[wandb]'); WANDB_MODE=offline works without
    network. Files go under <dump_folder>/wandb."""
    wandb_project: str = ""
    """W&B project. Empty: $WANDB_PROJECT, else "titan"."""
    wandb_run_name: str = ""
    """W&B run name. Empty: $WANDB_NAME, else W&B's generated name."""


@dataclass
class Stability:
    grad_norm_spike_window: int = 20
    """Steps in the running average the grad norm is compared with."""
    grad_norm_spike_threshold: float = 0.1
    """Absolute margin: a grad-norm spike is grad_norm > running average + this."""
    loss_spike_window: int = 20
    """Steps in the running average the loss is compared with."""
    loss_spike_threshold: float = 0.1
    """Relative margin: a loss spike is loss > running average * (1 + this)."""


@dataclass
class Validation:
    enable: bool = False
    """Compute loss and perplexity on held-out data every `freq` steps (and at the last step)."""
    dataset: str = "pydoc_validation"
    """Held-out dataset name from the registry (pydoc_validation: topics that pydoc_train leaves
    out; c4_validation) or a local path."""
    dataset_path: str = ""
    """Local file or folder to read instead of the registry source; for c4_validation, a mirror in
    allenai/c4's layout (en/c4-validation.*.json.gz)."""
    freq: int = 100
    """Validate every N training steps."""
    steps: int = -1
    """Batches per validation (local_batch_size x seq_len each, per dp rank). -1: the whole set."""
    local_batch_size: int = -1
    """Sequences per validation batch per dp rank. -1: training.local_batch_size."""


@dataclass
class Profiling:
    enable_profiling: bool = False
    """Record torch.profiler traces (CPU + CUDA activity), one trace per rank."""
    profile_freq: int = 10
    """Capture a trace every N steps (the last `active_steps` steps of each window)."""
    warmup_steps: int = 3
    """Profiler warm-up steps before the active steps of each window (not recorded)."""
    active_steps: int = 1
    """Steps recorded per trace."""
    save_traces_folder: str = "profile_traces"
    """Trace folder, relative to job.dump_folder: iteration_<step>/rank<r>_trace.json."""
    enable_memory_snapshot: bool = False
    """CUDA only: record allocator history and dump a snapshot every profile_freq steps and on
    out-of-memory (view at pytorch.org/memory_viz)."""
    save_memory_snapshot_folder: str = "memory_snapshot"
    """Snapshot folder, relative to job.dump_folder."""


@dataclass
class Comm:
    init_timeout_seconds: int = 300
    """Collective timeout while setting up (first step included: compile, loading)."""
    train_timeout_seconds: int = 100
    """Collective timeout from the second step on (a hang then fails fast)."""
    trace_buf_size: int = 20000
    """NCCL flight-recorder entries per rank (TORCH_NCCL_TRACE_BUFFER_SIZE); 0 disables it.
    With > 0 a timeout dumps the recorder to save_traces_folder."""
    save_traces_folder: str = "comm_traces"
    """Flight-recorder dump folder, relative to job.dump_folder (files rank_<r>)."""


@dataclass
class Checkpoint:
    enable: bool = False
    """Save checkpoints (and resume from them). `--checkpoint.enable` alone turns it on."""
    folder: str = "checkpoint"
    """Checkpoint folder, relative to job.dump_folder; holds one `step-N` DCP folder per save."""
    interval: int = 500
    """Save every N steps; the last step is always saved too."""
    keep_latest_k: int = 3
    """Keep only the newest K complete checkpoints; older ones are deleted after each save, so a
    long run's disk use stays bounded (an 8B checkpoint with AdamW states is ~100 GB). 0 keeps
    every checkpoint. The newest complete full checkpoint is never deleted, whatever K."""
    async_mode: AsyncMode = "disabled"
    """disabled (blocking save), async (write in a background thread while training goes on), or
    async_with_pinned_mem (also copy to host memory in the background; pinned when a GPU exists)."""
    last_save_model_only: bool = False
    """Make the final save (at training.steps) model weights only, in export_dtype: the export for
    inference or fine-tuning. Auto-resume ignores such exports."""
    export_dtype: DType = "float32"
    """dtype of the model-only final save: float32, bfloat16 or float16. Only with
    last_save_model_only; resumable checkpoints keep the training dtype."""
    load_step: int = -1
    """Step to resume from. -1: the newest complete checkpoint in folder (torn ones are skipped)."""
    exclude_from_loading: list[CheckpointPart] = field(default_factory=list)
    """Parts not to restore on resume: any of model, optimizer, lr_scheduler, dataloader,
    train_state (e.g. ["dataloader"] to switch datasets mid-run)."""
    initial_load_path: str = ""
    """DCP checkpoint folder to start from when folder holds no checkpoint yet (another run's
    step-N, a converted or seed checkpoint). Ignored once this run has its own checkpoints."""
    initial_load_model_only: bool = True
    """Load only the model weights from initial_load_path (True), or everything it holds minus
    exclude_from_loading (False)."""
    initial_load_in_hf: bool = False
    """initial_load_path is a Hugging Face folder (config.json + *.safetensors), not DCP; model
    weights only. Convert other formats with scripts/convert_hf.py or convert_llama_to_dcp.py."""
    last_save_in_hf: bool = False
    """At the end of training also write the model as a Hugging Face folder (config.json +
    sharded safetensors, in export_dtype) to <folder>/step-N-hf. Not with pipeline parallelism."""
    on_save_error: OnSaveError = "stop"
    """What a failed save (disk full, read-only, permission, any rank) does after its partial
    folder is removed: stop (exit with one line naming the cause) or retry (warn, keep training and
    save again at the next interval; the final save still stops on failure)."""
    config_mismatch: ConfigMismatch = "error"
    """Resuming from a checkpoint whose saved run config differs in a training-relevant key
    (model, optimizer, lr_scheduler, data, batch shape, float8; see docs/checkpointing.md): error
    (stop, naming the keys), use_checkpoint (continue with the checkpoint's values) or use_new
    (this run's values; the loaded lr and optimizer settings are replaced by today's)."""
    create_seed_checkpoint: bool = False
    """Write the initialized weights as folder/step-0 (model only) and exit. Needs 1 process and no
    parallelism; every layout that starts from it begins with identical weights."""


@dataclass
class ActivationCheckpoint:
    mode: ACMode = "none"
    """Recompute activations in backward instead of keeping them: none, full (every
    TransformerBlock keeps only its input) or selective (see selective_ac_option)."""
    selective_ac_option: int | str = "op"
    """With mode = selective: "op" keeps the outputs of every other matmul (and attention) per block
    and recomputes the rest; an integer N fully checkpoints every N-th block (layers 0, N, 2N...)."""


@dataclass
class Compile:
    enable: bool = False
    """torch.compile the parts named in `components` (inductor)."""
    components: list[CompileComponent] = field(default_factory=lambda: ["model", "loss"])
    """What to compile: model (each TransformerBlock, fullgraph) and/or loss (the cross entropy)."""


@dataclass
class Float8:
    enable_float8_linear: bool = False
    """Swap nn.Linear layers for torchao Float8Linear (float8 matmuls; needs CUDA SM89+ unless
    emulate)."""
    recipe: Float8Recipe = "tensorwise"
    """torchao scaling recipe: tensorwise (one scale per tensor) or rowwise (one per row)."""
    enable_fsdp_float8_all_gather: bool = False
    """FSDP2 all-gathers weights already cast to float8 (half the bytes of bf16); tensorwise only."""
    precompute_float8_dynamic_scale_for_fsdp: bool = False
    """After each optimizer step, compute all float8 weight scales with one all-reduce instead of
    one per layer in forward. Needs enable_fsdp_float8_all_gather."""
    filter_fqns: list[str] = field(default_factory=lambda: ["output"])
    """Linear layers whose name contains any of these strings stay in high precision. Layers with
    a dimension that is not a multiple of 16 are always skipped (float8 kernel requirement)."""
    emulate: bool = False
    """Run the float8 matmuls in high precision after the casts (for testing on CPU or GPUs older
    than SM89); numerics match float8, speed does not."""


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    metrics: Metrics = field(default_factory=Metrics)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    stability: Stability = field(default_factory=Stability)
    validation: Validation = field(default_factory=Validation)
    profiling: Profiling = field(default_factory=Profiling)
    comm: Comm = field(default_factory=Comm)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    float8: Float8 = field(default_factory=Float8)
