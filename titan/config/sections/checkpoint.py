"""[checkpoint]: the Checkpoint section of the config tree (assembled in titan/config/job_config.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from titan.config.choices import AsyncMode, CheckpointPart, ConfigMismatch, DType, OnSaveError
from titan.errors import require


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
    train_state (step, tokens seen), rng (each rank's random generators) (e.g. ["dataloader"] to
    switch datasets mid-run)."""
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
    """Write the final save (at training.steps) as a Hugging Face folder (config.json + sharded
    safetensors, in export_dtype) at <folder>/step-N, where torchtitan puts it: load it back with
    initial_load_path <dump_folder>/<folder>/step-N and initial_load_in_hf. Needs
    last_save_model_only; auto-resume passes over it. Not with pipeline parallelism."""
    hf_drop_routing_bias: bool = False
    """Let a Hugging Face export leave out the experts' routing bias of auxiliary-loss-free balancing
    for a family whose HF format has none (llama4, qwen3's MoE flavors, gpt_oss): the exported model
    then picks its experts by the router alone, unlike the trained one. Off: such an export (and a
    run with last_save_in_hf that trains the bias) is refused."""
    on_save_error: OnSaveError = "stop"
    """What a failed save (disk full, read-only, permission, any rank) does after its partial
    folder is removed: stop (exit with one line naming the cause) or retry (warn, keep training and
    save again at the next interval; the final save still stops on failure)."""
    config_mismatch: ConfigMismatch = "error"
    """Resuming from a checkpoint whose saved run config differs in a training-relevant key
    (model, optimizer, lr_scheduler, data, batch shape, float8; see docs/checkpointing.md): error
    (stop, naming the keys), use_checkpoint (continue with the checkpoint's values) or use_new
    (this run's values; the loaded lr and optimizer settings are replaced by today's). Also decides
    when the weights of initial_load_path (an HF folder, a converted DCP folder) were trained as
    another model (RoPE, norm eps, shapes): error, use_checkpoint (build the model with the folder's
    values) or use_new (keep this run's; not for other tensor shapes)."""
    memory_interval: int = -1
    """In-memory snapshots (with checkpoint.enable): every N steps each rank copies its state to host
    memory that outlives the process (memory_folder), in the background, and with more than one node
    a copy to a rank of another node; a restarted run resumes from the newest of them and the disk
    checkpoints. -1: every step whose previous snapshot is done (off when they do not fit the host
    memory; the start-up table says which); 0: off; N: every N steps (refused when they do not fit)."""
    memory_folder: str = "/dev/shm"
    """Node-local memory that outlives the processes (a tmpfs) where in-memory snapshots live, in a
    folder per job (titan-<dump folder name>-<hash>), removed when the run ends as it should."""
    memory_limit_gib: float = 0.0
    """Host memory one node's in-memory snapshots may take (two slots of each rank's state and of
    the copy it keeps for its peer). 0: half of MemAvailable in /proc/meminfo at start-up. The free
    space of memory_folder also caps it."""
    create_seed_checkpoint: bool = False
    """Write the initialized weights as folder/step-0 (model only) and exit. Needs 1 process and no
    parallelism; every layout that starts from it begins with identical weights."""

    def validate(self) -> None:
        require(self.interval >= 1, "checkpoint.interval", self.interval, "an integer >= 1")
        require(
            self.keep_latest_k >= 0, "checkpoint.keep_latest_k", self.keep_latest_k, "0 (keep all) or an integer >= 1"
        )
        require(self.load_step >= -1, "checkpoint.load_step", self.load_step, "-1 (latest) or a step >= 0")
        require(
            bool(self.folder.strip()), "checkpoint.folder", self.folder, "a non-empty folder name under job.dump_folder"
        )
        require(
            self.memory_interval >= -1,
            "checkpoint.memory_interval",
            self.memory_interval,
            "-1 (every step when they fit), 0 (off) or a step count >= 1",
        )
        require(bool(self.memory_folder.strip()), "checkpoint.memory_folder", self.memory_folder, "a folder (a tmpfs)")
        require(
            self.memory_limit_gib >= 0,
            "checkpoint.memory_limit_gib",
            self.memory_limit_gib,
            "0 (from /proc/meminfo) or GiB > 0",
        )
        require(
            not self.initial_load_in_hf or bool(self.initial_load_path),
            "checkpoint.initial_load_in_hf",
            rule="needs checkpoint.initial_load_path (the HF folder)",
        )
        require(
            not self.last_save_in_hf or self.last_save_model_only,
            "checkpoint.last_save_in_hf",
            rule="writes the final step-N as a Hugging Face folder (model weights only): also set"
            " checkpoint.last_save_model_only (add --checkpoint.last_save_model_only)",
        )
        # Loading options would silently do nothing with checkpointing off.
        for key, is_set in (
            ("initial_load_path", bool(self.initial_load_path)),
            ("load_step", self.load_step != -1),
            ("last_save_in_hf", self.last_save_in_hf),
            ("hf_drop_routing_bias", self.hf_drop_routing_bias),
            ("memory_interval", self.memory_interval > 0),
        ):
            require(
                not is_set or self.enable, f"checkpoint.{key}", rule="needs checkpoint.enable (add --checkpoint.enable)"
            )
