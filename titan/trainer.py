"""The training loop: config -> process group -> model -> parallelize -> data -> steps."""

from __future__ import annotations

import contextlib
import copy
import gc
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from titan.config.job_config import JobConfig
from titan.config.manager import to_dict
from titan.data import build_dataloader, build_tokenizer
from titan.errors import TitanError
from titan.loss import IGNORE_INDEX, cross_entropy_sum
from titan.lr_scheduler import build_lr_schedulers
from titan.metrics import MetricsProcessor
from titan.models import get_flavor, get_model_spec
from titan.optim import build_optimizers
from titan.parallel.compile import build_loss_fn
from titan.parallel.dims import ParallelDims
from titan.parallel.float8 import build_precompute_hook, check_float8_hardware, convert_to_float8
from titan.parallel.fsdp import DTYPES
from titan.parallel.init import init_model_weights
from titan.parallel.utils import clip_grad_norm_, init_distributed, pick_device, set_seed, world_info
from titan.tools.logging import init_logger, logger

DEFAULT_SEED = 0


def grad_accumulation_steps(config: JobConfig, dp_degree: int) -> int:
    t = config.training
    per_pass = t.local_batch_size * dp_degree
    if t.global_batch_size == -1:
        return 1
    if t.global_batch_size % per_pass:
        raise TitanError(
            f"config key 'training.global_batch_size' got {t.global_batch_size}; it must be a multiple of"
            f" local_batch_size x data-parallel degree = {t.local_batch_size} x {dp_degree} = {per_pass}"
        )
    return t.global_batch_size // per_pass


class Trainer:
    def __init__(self, config: JobConfig):
        self.config = config
        self.rank, local_rank, world_size = world_info()
        init_logger(self.rank)
        if config.job.print_config and self.rank == 0:
            logger.info(f"config: {to_dict(config)}")
        t = config.training

        # Everything that can be checked without a process group or a model, first.
        par = config.parallelism
        self.parallel_dims = ParallelDims(
            dp_replicate=par.data_parallel_replicate_degree,
            dp_shard=par.data_parallel_shard_degree,
            cp=1,
            tp=1,
            pp=1,
            world_size=world_size,
        )
        self.grad_accum_steps = grad_accumulation_steps(config, self.parallel_dims.dp_degree)
        spec = get_model_spec(config.model.name)
        model_args = copy.deepcopy(get_flavor(spec, config.model.flavor))
        tokenizer = build_tokenizer(config.model.tokenizer_path)

        self.device = pick_device(local_rank)
        init_distributed(self.device, world_size)
        self.parallel_dims.build_mesh(self.device.type)
        seed = DEFAULT_SEED if t.seed is None else t.seed
        set_seed(seed, t.deterministic)

        # Model: built on meta, parallelized, then materialized and initialized.
        if model_args.vocab_size != tokenizer.vocab_size:
            logger.info(f"model vocab_size {model_args.vocab_size} -> {tokenizer.vocab_size} (from the tokenizer)")
        model_args.vocab_size = tokenizer.vocab_size
        model_args.max_seq_len = t.seq_len
        model_args.attn_type = config.model.attn_type
        model_args.validate()
        with torch.device("meta"):
            model = spec.model_cls(model_args)
        self.num_params, self.flops_per_token = spec.get_nparams_and_flops(model, t.seq_len)
        logger.info(
            f"model {spec.name} {config.model.flavor}: {self.num_params:,} parameters,"
            f" {self.flops_per_token:,} training FLOPs/token at seq_len {t.seq_len}"
        )
        check_float8_hardware(config.float8, self.device)
        self.float8_fqns = convert_to_float8(model, config.float8, fsdp_enabled=self.parallel_dims.fsdp_enabled)
        model = spec.parallelize_fn(model, self.parallel_dims, config)
        model.to_empty(device=self.device)
        init_model_weights(model, seed, buffer_device=self.device)
        model.train()
        self.model_parts = [model]
        # Without FSDP there is no MixedPrecisionPolicy: autocast gives the same compute dtype.
        self.amp = self._autocast_context(model_args)

        self.optimizers = build_optimizers(self.model_parts, config.optimizer)
        precompute = build_precompute_hook(self.model_parts, config.float8, self.parallel_dims.fsdp_enabled)
        if precompute is not None:
            self.optimizers.register_step_post_hook(precompute)
        self.loss_fn = build_loss_fn(cross_entropy_sum, config.compile.enable and "loss" in config.compile.components)
        self.lr_schedulers = build_lr_schedulers(self.optimizers, config.lr_scheduler, t.steps)

        self.dp_rank = self.parallel_dims.dp_rank()
        self.dataloader = build_dataloader(
            dataset=t.dataset,
            dataset_path=t.dataset_path,
            text_field=t.dataset_text_field,
            txt_split=t.dataset_txt_split,
            tokenizer=tokenizer,
            seq_len=t.seq_len,
            local_batch_size=t.local_batch_size,
            dp_rank=self.dp_rank,
            dp_world_size=self.parallel_dims.dp_degree,
            num_workers=t.dataloader_num_workers,
            infinite=t.dataset_infinite,
        )
        self.metrics = MetricsProcessor(
            config, rank=self.rank, device=self.device, num_flops_per_token=self.flops_per_token,
            float8=bool(self.float8_fqns),
        )
        self.step = 0
        self.tokens_seen = 0
        self._batches: Iterator | None = None
        gc.disable()  # collected every gc_freq steps instead, so pauses don't differ across ranks

    def _autocast_context(self, model_args) -> contextlib.AbstractContextManager:  # noqa: ANN001
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

    def train_step(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward/backward over the micro-batches, clip, optimizer + LR step.

        Returns (global mean token loss, total grad norm) as tensors; no host sync here.
        """
        self.optimizers.zero_grad()
        model = self.model_parts[0]
        global_tokens = self._global_token_count(microbatches)
        # Data-parallel wrappers average gradients over dp ranks; scaling by dp turns that into the
        # sum over ranks, so the gradient is that of (sum of token losses / global tokens).
        dp_scale = self.parallel_dims.dp_degree
        loss_sum = torch.zeros((), device=self.device)
        for inputs, labels in microbatches:
            with self.amp:
                logits = model(inputs)
            local = self.loss_fn(logits, labels) / global_tokens
            del logits
            (local * dp_scale).backward()
            loss_sum += local.detach()
            self.metrics.count_tokens(labels.numel())
        params = [p for m in self.model_parts for p in m.parameters()]
        grad_norm = clip_grad_norm_(params, self.config.training.max_norm)
        self.optimizers.step()
        self.lr_schedulers.step()
        dp = self.parallel_dims.submesh("dp")
        if dp is not None:
            dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM, group=dp.get_group())
        return loss_sum, grad_norm

    # ------------------------------------------------------------ loop
    def train(self) -> dict[int, float]:
        """Train to training.steps (or until finite data ends); returns {step: loss} of logged steps."""
        t = self.config.training
        losses: dict[int, float] = {}
        logger.info(
            f"training {t.steps} steps: local batch {t.local_batch_size} x seq {t.seq_len},"
            f" dp {self.parallel_dims.dp_degree}, grad accumulation {self.grad_accum_steps}"
        )
        while self.step < t.steps:
            microbatches = self.next_microbatches()
            if microbatches is None:
                logger.warning(f"data exhausted after step {self.step}; stopping")
                break
            self.step += 1
            if self.step % t.gc_freq == 0:
                gc.collect(1)
            loss, grad_norm = self.train_step(microbatches)
            self.tokens_seen += sum(lab.numel() for _, lab in microbatches) * self.parallel_dims.dp_degree
            if self.metrics.should_log(self.step):
                loss_value = loss.item()
                losses[self.step] = loss_value
                self.metrics.log(
                    self.step, loss=loss_value, grad_norm=grad_norm.item(), lr=self.lr_schedulers.get_last_lr()
                )
        self.metrics.close()
        logger.info("training done")
        return losses
