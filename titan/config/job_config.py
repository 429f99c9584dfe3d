"""The configuration tree: one dataclass per TOML section.

Every field has a type, a default and a docstring (the string literal right under it). The CLI
flags, ``--help`` and docs/config_reference.md are all generated from these classes, so this file
is the only list of options.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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


@dataclass
class Model:
    name: str = "llama3"
    """Model family from the registry in titan/models (currently: llama3)."""
    flavor: str = "debugmodel"
    """Model size: debugmodel, 8B, 70B, 405B."""
    tokenizer_path: str = ""
    """Tokenizer file (tiktoken `tokenizer.model`, sentencepiece `.model` or HF `tokenizer.json`).
    Empty: the small tokenizer shipped in titan/data/assets."""
    attn_type: str = "sdpa"
    """Attention backend: sdpa (torch scaled_dot_product_attention) or flex (flex_attention)."""


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
    implementation: str = "foreach"
    """Kernel choice: for-loop, foreach or fused (fused needs a device that supports it)."""


@dataclass
class LRScheduler:
    warmup_steps: int = 200
    """Linear warmup steps from ~0 to the peak lr."""
    decay_ratio: float | None = None
    """Fraction of steps spent decaying at the end (WSD: warmup, stable, decay). None: decay over
    all steps after warmup."""
    decay_type: str = "linear"
    """Shape of the decay: linear, sqrt or cosine."""
    min_lr_factor: float = 0.0
    """Final lr as a fraction of the peak lr."""


@dataclass
class Training:
    dataset: str = "pydoc"
    """Dataset name from the registry (pydoc: the embedded offline corpus, c4, c4_validation) or
    a local path when `dataset_path` is set."""
    dataset_path: str = ""
    """Local file or folder (jsonl/json/parquet/arrow/txt) to read instead of the hub source."""
    dataset_text_field: str = "text"
    """Column that holds the document text in local / hub datasets."""
    dataset_txt_split: str = "paragraph"
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
    """Use deterministic algorithms (slower); for debugging numerics."""
    mixed_precision_param: str = "bfloat16"
    """FSDP parameter dtype in forward/backward: bfloat16 or float32 (on CPU bfloat16 matmuls are
    very slow; use float32 there)."""
    mixed_precision_reduce: str = "float32"
    """FSDP gradient reduce dtype: float32 or bfloat16."""
    dataset_infinite: bool = True
    """Re-loop over the dataset when it ends (logged, with an epoch counter). False: training
    stops cleanly when the data runs out."""
    dataloader_num_workers: int = 0
    """Worker processes that prefetch batches (0: load in the training process)."""
    gc_freq: int = 50
    """Run Python's garbage collector every N steps (automatic gc is disabled to avoid stalls)."""


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = 1
    """Replicas of the model (DDP, or HSDP together with data_parallel_shard_degree)."""
    data_parallel_shard_degree: int = -1
    """FSDP shard group size. -1: the ranks left over by the other degrees."""
    fsdp_reshard_after_forward: str = "default"
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
    two per rank for multi-stage ones, layers split evenly."""
    context_parallel_degree: int = 1
    """Context parallel degree: each sequence is split over this many ranks (ring attention).
    training.seq_len must be divisible by 2 x this degree (head-tail load balancing)."""
    context_parallel_rotate_method: str = "allgather"
    """How context-parallel ranks exchange key/value shards: allgather or alltoall."""


@dataclass
class Metrics:
    log_freq: int = 10
    """Log one console line (and TensorBoard scalars) every N steps."""
    enable_tensorboard: bool = False
    """Write TensorBoard event files."""
    save_tb_folder: str = "tb"
    """TensorBoard folder, relative to job.dump_folder."""
    disable_color_printing: bool = False
    """Plain console output without ANSI colors."""


@dataclass
class ActivationCheckpoint:
    mode: str = "none"
    """Recompute activations in backward instead of keeping them: none, full (every
    TransformerBlock keeps only its input) or selective (see selective_ac_option)."""
    selective_ac_option: int | str = "op"
    """With mode = selective: "op" keeps the outputs of every other matmul (and attention) per block
    and recomputes the rest; an integer N fully checkpoints every N-th block (layers 0, N, 2N...)."""


@dataclass
class Compile:
    enable: bool = False
    """torch.compile the parts named in `components` (inductor)."""
    components: list[str] = field(default_factory=lambda: ["model", "loss"])
    """What to compile: model (each TransformerBlock, fullgraph) and/or loss (the cross entropy)."""


@dataclass
class Float8:
    enable_float8_linear: bool = False
    """Swap nn.Linear layers for torchao Float8Linear (float8 matmuls; needs CUDA SM89+ unless
    emulate)."""
    recipe: str = "tensorwise"
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
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    float8: Float8 = field(default_factory=Float8)
