"""The training loop: config -> process group -> model -> parallelize -> data -> steps."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from titan.checkpointing import config_diff
from titan.checkpointing.manager import CheckpointManager
from titan.checkpointing.model_settings import settle as settle_model_settings
from titan.checkpointing.resume import prepare_run
from titan.checkpointing.states import ModelParts, RNGState, TrainState
from titan.config.dialects import log_translations
from titan.config.job_config import JobConfig
from titan.config.manager import to_dict
from titan.config.output import save_config
from titan.ft.replicas import join_replica_groups
from titan.log import init_logger, logger
from titan.parallel.comm import set_comm_env, set_pg_timeouts
from titan.parallel.compile import build_loss_fn
from titan.parallel.cp import cp_shard_batch
from titan.parallel.fsdp import DTYPES
from titan.parallel.utils import init_distributed, pick_device, set_seed, world_info
from titan.training.build import build_loader, build_model, build_optimizers_and_schedulers, init_weights
from titan.training.checks import check_job, checked_by_launcher, replan
from titan.training.determinism import DeterministicMode
from titan.training.forward import ModelForward
from titan.training.gc_handler import GarbageCollection
from titan.training.goodput import GoodputRecorder
from titan.training.loss import IGNORE_INDEX, ScaledLoss, cross_entropy_sum, token_loss
from titan.training.metrics import MetricsProcessor
from titan.training.moe import MoEMonitor
from titan.training.nonfinite import UpdateMask
from titan.training.plan import check_run
from titan.training.profiling import Profiler
from titan.training.stability import StabilityMonitor, StepResult, param_norm
from titan.training.startup import log_summary, summary_rows
from titan.training.validator import Validator

DEFAULT_SEED = 0
T = TypeVar("T")


class Trainer:
    def __init__(self, config: JobConfig):
        self.config = config
        self.rank, local_rank, world_size = world_info()
        init_logger(self.rank)
        log_translations(config.translations)  # the torchtitan keys the loader translated
        t = config.training

        # Everything that can be checked without a process group or a model, first (the device type
        # is asked without touching the device); what titan's launcher already read is not read again.
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        plan = check_job(config, world_size, device_type, once=not checked_by_launcher(), lighthouse="required")
        assert plan is not None  # a world size was given
        self.plan = plan
        self.parallel_dims, self.grad_accum_steps = self.plan.parallel_dims, self.plan.grad_accum_steps
        # Before the device is touched: cuBLAS reads its workspace setting when first created.
        self.determinism = DeterministicMode(t.deterministic).apply()
        self.device = pick_device(local_rank)
        # NCCL reads the flight-recorder env when its groups are created
        set_comm_env(config.comm, config.job.dump_folder, nccl=self.device.type == "cuda")
        init_distributed(self.device, world_size, timeout_s=config.comm.init_timeout_seconds)
        self.parallel_dims.build_mesh(self.device.type)
        # Before anything is written to the dump folder: lock it, pick the checkpoint to resume
        # and settle its config against this one (may change config: checkpoint.config_mismatch).
        self.run_start = prepare_run(config, self.rank, world_size, self.parallel_dims.dp_degree)
        if self.run_start.config_diff and config.checkpoint.config_mismatch == "use_checkpoint":
            self.plan = replan(self.config, world_size, self.device.type, self.parallel_dims)
            self.grad_accum_steps = self.plan.grad_accum_steps
        plan, tokenizer = self.plan, self.plan.tokenizer
        self.stability = StabilityMonitor(
            config.stability, nonfinite=t.nonfinite, max_consecutive_skips=t.nonfinite_max_consecutive_skips
        )
        seed = DEFAULT_SEED if t.seed is None else t.seed
        set_seed(seed)

        # Model: built on meta, parallelized, then materialized and initialized.
        # Weights brought in (HF folder, converted DCP) decide or veto the model settings first.
        if settle_model_settings(
            config, plan.spec, plan.model_args, self.run_start.found is not None, tokenizer.vocab_size
        ):
            check_run(config, self.parallel_dims, plan.model_args, self.device.type)
        ce = build_loss_fn(cross_entropy_sum, config.compile.enable and "loss" in config.compile.components)
        self.loss_fn = token_loss(config, plan.model_args, ce)  # full logits or by chunks; MTP depths
        pp_loss = ScaledLoss(self.loss_fn)
        built = build_model(config, plan, self.parallel_dims, self.device, pp_loss)
        self.model_parts, self.pp_schedule, self.float8_fqns = built.parts, built.pp_schedule, built.float8_fqns
        self.num_params, self.flops_per_token = built.num_params, built.flops_per_token
        init_weights(self.model_parts, seed, self.device, cpu_offload=t.enable_cpu_offload)
        # Position-indexed buffers (the RoPE table) that CP shards with each batch: fixed per run.
        cp_buffers_fn = plan.spec.cp_buffers_fn
        self._cp_buffers = [b for part in self.model_parts for b in cp_buffers_fn(part)] if cp_buffers_fn else []
        pp = self.parallel_dims.submesh("pp")
        self._pp_group = pp.get_group() if pp is not None else None
        self.forward = ModelForward(
            self.model_parts,
            self.loss_fn,
            device=self.device,
            loss_parallel_enabled=self.parallel_dims.loss_parallel_enabled,
            amp=self._autocast_context(),
            eos_id=plan.eos_id,
            pp_schedule=built.pp_schedule,
            pp_loss=pp_loss,
            pp_has_first=built.pp_has_first,
            pp_has_last=built.pp_has_last,
            pp_group=self._pp_group,
        )

        self.optimizers, self.lr_schedulers, self.qk_clip = build_optimizers_and_schedulers(
            config, self.model_parts, self.parallel_dims, self.device
        )
        # Before any optimizer state exists (the checkpoint load below creates it).
        self.update_mask = UpdateMask(self.optimizers, self.device, enabled=t.nonfinite == "skip_step")
        # Fixed from here on (checkpoint loads copy into them): not rebuilt every step.
        self._params = [p for m in self.model_parts for p in m.parameters()]
        self.moe_monitor = MoEMonitor(self.model_parts)

        self.dp_rank = self.parallel_dims.dp_rank()
        self.dataloader = build_loader(config, tokenizer, self.parallel_dims)
        self.metrics = MetricsProcessor(
            config.metrics,
            dump_folder=config.job.dump_folder,
            run_config=to_dict(config),
            rank=self.rank,
            device=self.device,
            num_flops_per_token=self.flops_per_token,
            non_data_parallel_size=self.parallel_dims.non_data_parallel_size,
            float8=bool(self.float8_fqns),
        )
        self.validator = None
        if config.validation.enable:
            self.validator = Validator(
                config.validation,
                last_step=t.steps,
                model_parts=self.model_parts,
                parallel_dims=self.parallel_dims,
                device=self.device,
                metrics=self.metrics,
                loader=build_loader(config, tokenizer, self.parallel_dims, validation=True),
                loss_sum=self.forward.eval_loss_sum,
                cp_buffers=self._cp_buffers,
                cp_rotate_method=config.parallelism.context_parallel_rotate_method,
            )
        self.train_state = TrainState()  # step and tokens seen: saved and restored with the checkpoint
        self._batches: Iterator | None = None
        # Last in set-up: the manager saves the states above and restores them (auto-resume) if there is a checkpoint.
        dp_degree = self.parallel_dims.dp_degree
        self.checkpointer = CheckpointManager(
            config.checkpoint,
            states={
                "model": ModelParts(self.model_parts),
                "optimizer": self.optimizers,
                "lr_scheduler": self.lr_schedulers,
                "train_state": self.train_state,
            },
            rank_states={"rng": RNGState(), "dataloader": self.dataloader},
            dump_folder=config.job.dump_folder,
            overwrite=config.job.overwrite,
            total_steps=config.training.steps,
            config_record=config_diff.snapshot(config, dp_degree),
            world_size=self.parallel_dims.world_size,
            rank=self.rank,
            dp_rank=self.dp_rank,
            dp_degree=dp_degree,
            num_params=self.num_params,
            start=self.run_start,
        )
        # Every save first reads the non-finite record: a stopped run writes no checkpoint after a NaN.
        self.checkpointer.before_save = self.stability.resolve
        ft, dump = config.fault_tolerance, config.job.dump_folder
        self.replicas = join_replica_groups(ft, self.checkpointer, self.device, log_folder=dump)
        self.checkpointer.load()
        self.replicas.after_load(self.checkpointer)  # a restarted group's data reads on from its last step
        self.goodput = GoodputRecorder(config, rank=self.rank, step=self.step, metrics=self.metrics)
        self.goodput.replicas = self.replicas.record  # replica groups: committed, discarded, heals
        if self.rank == 0:  # the run is committed to start here (its checkpoint folder checked or resumed)
            log_summary(
                summary_rows(
                    config,
                    device=self.device,
                    parallel_dims=self.parallel_dims,
                    model_parts=self.model_parts,
                    num_params=self.num_params,
                    flops_per_token=self.flops_per_token,
                    peak_flops=self.metrics.peak_flops,
                    float8=bool(self.float8_fqns),
                    snapshots=self.checkpointer.snapshots_text,
                )
            )
            logger.info(f"merged config saved to {save_config(config)} (repeat the run with --job.config_file)")

    @property
    def step(self) -> int:
        """Optimizer steps done so far (``train_state.step``)."""
        return self.train_state.step

    def _cp_context(self, inputs: torch.Tensor, labels: torch.Tensor) -> contextlib.AbstractContextManager:
        """CP: forward and backward see this rank's sequence shard (and RoPE rows)."""
        cp = self.parallel_dims.submesh("cp")  # None without CP
        if cp is None:
            return contextlib.nullcontext((inputs, labels))
        rotate = self.config.parallelism.context_parallel_rotate_method
        return cp_shard_batch(cp, inputs, labels, self._cp_buffers, rotate)

    def _autocast_context(self) -> contextlib.AbstractContextManager:
        """Without FSDP there is no MixedPrecisionPolicy: autocast gives the same compute dtype."""
        dtype = self.config.training.mixed_precision_param
        if self.parallel_dims.fsdp_enabled or dtype == "float32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=DTYPES[dtype])

    # ------------------------------------------------------------ one step
    def next_microbatches(self) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        if self._batches is None:
            self._batches = iter(self.dataloader)
        out = []
        t0 = time.perf_counter()
        for _ in range(self.grad_accum_steps):
            try:
                # A new DataLoader iterator draws a seed from the global RNG; resume restores that
                # RNG, so the draw (once per process) must not move it, or resumed runs drift.
                with torch.random.fork_rng(devices=[]):
                    inputs, labels = next(self._batches)
            except StopIteration:
                return None
            out.append((inputs.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True)))
        self.metrics.add_data_time(time.perf_counter() - t0)
        return out

    def _global_token_count(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        count = sum((labels != IGNORE_INDEX).sum() for _, labels in microbatches)
        count = torch.as_tensor(count, dtype=torch.int64, device=self.device)
        dp = self.parallel_dims.submesh("dp")
        if dp is not None:
            dist.all_reduce(count, op=dist.ReduceOp.SUM, group=dp.get_group())
        return count.clamp(min=1)

    def _param_norm_due(self, step: int) -> bool:
        freq = self.config.metrics.param_norm_freq
        return freq > 0 and self.metrics.should_log(step) and (step == 1 or step % freq == 0)

    def train_step(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]]) -> StepResult:
        """Forward/backward over the micro-batches (moved to the device if they are not there yet),
        clip, optimizer + LR step.

        No host read: the non-finite policy is decided and applied on the device
        (titan/training/stability.py, titan/training/nonfinite.py). On log steps the loss is summed
        over the dp (x cp) ranks and the result carries every logged tensor for the loop's one read.
        """
        microbatches = [
            (x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)) for x, y in microbatches
        ]
        self.optimizers.zero_grad()
        self.qk_clip.track(self.step, logs := self.metrics.should_log(self.step))  # largest logits: clip or log
        self.replicas.start_step()
        global_tokens = self._global_token_count(microbatches)
        # Data-parallel wrappers average gradients over dp (x cp) ranks; scaling by that turns it
        # into the sum over ranks, so the gradient is that of (sum of token losses / global tokens).
        dp_scale = self.parallel_dims.dp_degree * self.parallel_dims.cp
        loss_sum = torch.zeros((), device=self.device)
        for full_inputs, full_labels in microbatches:
            with self._cp_context(full_inputs, full_labels) as (inputs, labels):
                loss_sum += self.forward.forward_backward(inputs, labels, global_tokens, dp_scale)
            self.metrics.count_tokens(full_labels.numel())
        # The container clips (or, stepping in backward, reports the norm its hooks summed); under CPU
        # offload the gradients, and so their norm, live on the host.
        self.replicas.sync_gradients(self._params)  # averaged over replica groups, or dropped if discarded
        max_norm = self.config.training.max_norm
        grad_norm = self.optimizers.clip_grad_norm_(self._params, max_norm, self._pp_group).to(self.device)
        # Non-finite policy (training.nonfinite): a skipped step still advances step and LR.
        apply = self.stability.check(self.step, loss_sum, grad_norm)
        # A whole-model pass: only on the log steps that show it, on the weights entering the step.
        extra = {"param_norm": param_norm(self.model_parts, self._pp_group)} if self._param_norm_due(self.step) else {}
        with self.update_mask(apply):
            self.optimizers.step()
        self.lr_schedulers.step()
        extra.update(self.moe_monitor.log_tensors() | self.qk_clip.log_tensors() if logs else {})
        extra.update(self.forward.mtp_log_tensors(logs, self.parallel_dims))
        # CP ranks hold the loss of their sequence shard: the total sums over dp x cp (logged steps only).
        dp_cp = self.parallel_dims.submesh("dp_cp")
        if dp_cp is not None and logs:
            dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM, group=dp_cp.get_group())
        return StepResult(loss_sum, grad_norm, extra)

    # ------------------------------------------------------------ loop
    def _checkpoint_timed(self, fn: Callable[..., T], *args: Any, may_save: bool = False) -> T:
        """Run a checkpoint hook with its wall time kept out of tokens/s and MFU and logged on its
        own (time_metrics/checkpoint(s)). Before a save the device finishes the step's queued work
        first, so the step's own compute is not counted as checkpoint time."""
        if may_save and self.device.type == "cuda" and self.checkpointer.should_save(self.step):
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.metrics.add_checkpoint_time(time.perf_counter() - t0)
            self.goodput.add("checkpoint", time.perf_counter() - t0)

    def train(self) -> dict[int, float]:
        """Train to training.steps (or until finite data ends); returns {step: loss} of logged steps.
        Automatic garbage collection is off meanwhile (titan/training/gc_handler.py); it and the
        deterministic-mode settings are back as they were after, also after a failure."""
        try:
            with GarbageCollection(self.config.training.gc_freq) as self.gc:
                return self._train()
        except BaseException as e:
            self.goodput.failed(self.step, self.checkpointer.last_saved_step, e)
            raise
        finally:
            self.determinism.restore()  # process-wide settings: in-process runs (tests) must not inherit them

    def _train(self) -> dict[int, float]:
        t = self.config.training
        losses: dict[int, float] = {}
        logger.info(
            f"training {t.steps} steps: local batch {t.local_batch_size} x seq {t.seq_len},"
            f" dp {self.parallel_dims.dp_degree}, grad accumulation {self.grad_accum_steps}"
        )
        if self.config.checkpoint.create_seed_checkpoint:
            self.checkpointer.create_seed_checkpoint()
            return losses
        self.metrics.reset(self.step)
        self.checkpointer.install_signal_handlers()
        profiler = Profiler(
            self.config.profiling,
            dump_folder=self.config.job.dump_folder,
            rank=self.rank,
            device=self.device,
            start_step=self.step,
        )
        first_step, preempted = True, False
        self.goodput.begin(self.checkpointer.load_seconds)
        while self.step < t.steps:
            microbatches = self.next_microbatches()
            if microbatches is None:
                logger.warning(f"data exhausted after step {self.step}; stopping")
                break
            self.train_state.step += 1
            self.gc.step(self.step)
            # An async save may still be copying the weights.
            self._checkpoint_timed(self.checkpointer.wait_for_staging)
            result = self.train_step(microbatches)
            self.train_state.tokens_seen += sum(lab.numel() for _, lab in microbatches) * self.parallel_dims.dp_degree
            values = None
            if self.metrics.should_log(self.step):
                # The step's one host read: logged values and the non-finite record (may raise).
                values = self.stability.read(self.step, result.loss, result.grad_norm, result.extra)
                losses[self.step] = values.loss
                self.moe_monitor.check(self.step, values.extra)
            self.goodput.step_done(self.step, self.checkpointer.last_saved_step)
            # The step's interval save comes before its line, which shows the save's seconds.
            self._checkpoint_timed(self.checkpointer.save_if_due, self.step, may_save=True)
            if values is not None:
                self.metrics.log(
                    self.step,
                    loss=values.loss,
                    grad_norm=values.grad_norm,
                    lr=self.lr_schedulers.last_step_lr(),  # the rate this step used
                    extra={**values.extra, **self.stability.console()},
                    extra_scalars={**self.stability.scalars(), **self.dataloader.scalars()},
                )
            if self.validator is not None and self.validator.should_validate(self.step):
                self.stability.resolve(self.step)  # a stopped run does not validate non-finite weights
                with self.goodput.lost("validation"):
                    self.validator.validate(self.step)
            profiler.step(self.step)
            if first_step:  # start-up is over: from now on a hang should fail fast
                set_pg_timeouts(self.config.comm.train_timeout_seconds, self.parallel_dims, self.device)
                first_step = False
            if self._checkpoint_timed(self.checkpointer.after_step, self.step):  # a signal; the snapshot
                preempted = True
                break
        profiler.close()
        self.stability.resolve(self.step)  # non-finite steps after the last log step are reported too
        self._checkpoint_timed(self.checkpointer.finish, self.step, preempted)
        self.goodput.end(
            self.step, self.checkpointer.last_saved_step, "stopped after a signal" if preempted else "finished"
        )
        self.metrics.close()
        logger.info("training done")
        return losses
