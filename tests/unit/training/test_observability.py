"""W&B (offline), profiler / memory-snapshot set-up and the optimizer options."""

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.helpers import tiny
from tests.helpers.tiny import TINY
from titan.config import load_config
from titan.config.job_config import Job, JobConfig, Metrics
from titan.errors import TitanError
from titan.models.llama.model import Transformer
from titan.training.checks import load_job
from titan.training.metrics import MetricsProcessor
from titan.training.optim import build_optimizers, cast_params_for_optimizer
from titan.training.plan import plan_run
from titan.training.profiling import Profiler

REPO = Path(__file__).resolve().parents[3]


def _processor(cfg: JobConfig, *, rank: int, flops: int = 1) -> MetricsProcessor:
    return MetricsProcessor(
        cfg.metrics, dump_folder=cfg.job.dump_folder, rank=rank, device=torch.device("cpu"), num_flops_per_token=flops
    )


def test_wandb_offline_run_writes_files(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_PROJECT", "titan-test")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = JobConfig(
        job=Job(dump_folder=str(tmp_path)),
        metrics=Metrics(enable_wandb=True, enable_jsonl=False, wandb_run_name="unit"),
    )
    mp = MetricsProcessor(
        cfg.metrics,
        dump_folder=cfg.job.dump_folder,
        rank=0,
        device=torch.device("cpu"),
        num_flops_per_token=10,
        run_config={"job": {"dump_folder": str(tmp_path)}},
    )
    assert mp.wandb.project == "titan-test" and mp.wandb.name == "unit"
    mp.count_tokens(100)
    mp.log(1, loss=2.0, grad_norm=1.0, lr=1e-3, extra={"param_norm": 3.0})
    mp.log_validation(1, loss=2.5, perplexity=12.2, tokens=10, seconds=0.1)
    mp.close()
    # wandb's service process writes the file and finish() can return before its last flush lands:
    # teardown() waits for the service to finish and stop
    import wandb

    wandb.teardown()
    [run_dir] = (tmp_path / "wandb").glob("offline-run-*")
    [data] = run_dir.glob("run-*.wandb")
    # the run's records (protobuf) carry the metric names and the project in plain bytes
    needles = (b"validation/loss", b"param_norm", b"loss_metrics/global_avg_loss", b"titan-test")
    assert not [n for n in needles if n not in data.read_bytes()]


def test_wandb_missing_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    cfg = JobConfig(job=Job(dump_folder=str(tmp_path)), metrics=Metrics(enable_wandb=True, enable_jsonl=False))
    with pytest.raises(TitanError, match=r"metrics.enable_wandb needs the wandb package: pip install 'titan\[wandb\]'"):
        _processor(cfg, rank=0, flops=10)


def test_log_rank_selects_the_writer(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    cfg = JobConfig(job=Job(dump_folder=str(tmp_path)), metrics=Metrics(log_rank=4))
    with pytest.raises(TitanError, match="metrics.log_rank' got 4.*below the world size 4"):
        _processor(cfg, rank=0)
    cfg.metrics.log_rank = 1
    assert not _processor(cfg, rank=0).log_this_rank
    mp = _processor(cfg, rank=1)
    assert mp.log_this_rank and mp.jsonl_path is not None
    mp.close()
    cfg.metrics.log_rank = -1
    mp = _processor(cfg, rank=3)
    assert mp.jsonl_path.endswith("-rank3.jsonl")
    mp.close()


def test_memory_snapshot_on_cpu_is_an_error(tmp_path):
    c = load_config(["--job.dump_folder", str(tmp_path), "--profiling.enable_memory_snapshot"])
    with pytest.raises(TitanError, match="profiling.enable_memory_snapshot needs CUDA.*this run is on cpu"):
        plan_run(c, 1, "cpu")


def test_memory_snapshot_wiring_on_cuda(tmp_path, monkeypatch):
    """No GPU here: the CUDA allocator hooks are replaced by recorders to check what is called when."""
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **kw: calls.append(("record", kw)))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: Path(path).write_bytes(b"snap"))
    observers = []
    monkeypatch.setattr(torch._C, "_cuda_attach_out_of_memory_observer", observers.append, raising=False)
    c = load_config(
        ["--job.dump_folder", str(tmp_path), "--profiling.enable_memory_snapshot", "--profiling.profile_freq", "2"]
    )
    prof = Profiler(c.profiling, dump_folder=c.job.dump_folder, rank=3, device=torch.device("cuda", 0))
    prof.step(1)
    prof.step(2)
    observers[0](0, 2**30, 2**34, 2**20)  # what the allocator calls on OOM
    prof.close()
    snaps = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.pickle"))
    assert snaps == [
        "memory_snapshot/iteration_2/rank3_memory_snapshot.pickle",
        "memory_snapshot/oom/rank3_memory_snapshot.pickle",
    ]
    assert calls == [("record", {"max_entries": 100_000}), ("record", {"enabled": None})]


def test_profiling_window_must_fit():
    with pytest.raises(TitanError, match=r"warmup_steps \+ profiling.active_steps \(3 \+ 1\).*profile_freq \(2\)"):
        load_job(["--profiling.enable_profiling", "--profiling.profile_freq", "2"])


def test_weight_decay_exclude_groups_and_checkpoint_round_trip():
    c = load_config(["--optimizer.weight_decay_exclude", "norms,embeddings", "--optimizer.weight_decay", "0.5"])
    model = tiny.build()
    opt = build_optimizers([model], c.optimizer)
    [o] = opt.optimizers
    names = {id(p): n for n, p in model.named_parameters()}
    decay = {g["weight_decay"]: sorted(names[id(p)] for p in g["params"]) for g in o.param_groups}
    assert decay[0.0] == [
        "layers.0.attention_norm.weight",
        "layers.0.ffn_norm.weight",
        "layers.1.attention_norm.weight",
        "layers.1.ffn_norm.weight",
        "norm.weight",
        "tok_embeddings.weight",
    ]
    assert "output.weight" in decay[0.5] and len(decay[0.5]) == 15
    model(torch.randint(0, TINY.vocab_size, (2, 8))).sum().backward()
    opt.step()
    state = opt.state_dict()
    assert state["param_groups.norm.weight.weight_decay"] == 0.0
    fresh = build_optimizers([model], c.optimizer)
    fresh.load_state_dict(state)
    assert [g["weight_decay"] for g in fresh.optimizers[0].param_groups] == [0.5, 0.0]
    with pytest.raises(TitanError, match="'optimizer.weight_decay_exclude' got 'biases'; valid: norms, embeddings"):
        load_config(["--optimizer.weight_decay_exclude", "biases"])


def test_bf16_stochastic_round_options():
    with pytest.raises(
        TitanError, match=r"optimizer.name' got 'Adam'; valid: AdamW with optimizer.bf16_stochastic_round"
    ):
        load_job(["--optimizer.bf16_stochastic_round", "--optimizer.name", "Adam"])
    c = load_config(["--optimizer.bf16_stochastic_round"])
    with torch.device("meta"):
        model = Transformer(replace(TINY, n_layers=1, tie_embeddings=True))
    cast_params_for_optimizer(model, c.optimizer)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.output.weight is model.tok_embeddings.weight  # still tied
    assert model.freqs_cis.dtype == torch.complex64  # buffers untouched
    assert type(build_optimizers([model], c.optimizer).optimizers[0]).__name__ == "_AdamW"
