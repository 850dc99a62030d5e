"""The MegaSlide offload engine against the offloading peers a new user would reach for, in one run on one
GPU: the same model, weights, clip, batch, optimizer settings and device.

    python -m experiments.offload_peers                         # H200: 7B width, 20 blocks, 32768 tokens
    python -m experiments.offload_peers model.depth=8 peers=[fsdp2]
    python -m experiments.offload_peers smoke=true              # CPU smoke: tiny model, gloo, seconds

Rows (each in a fresh process, experiments/step_runs.run_isolated, so an OOM or a crash sinks only its row):
- `ours`: the offload engine as train.py builds it (`Trainer` with offload.enabled);
- `fsdp2`: `fully_shard` per block and on the root, on a 1-rank process group, with
  `CPUOffloadPolicy(pin_memory=True)` and `MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`,
  built on the meta device, `to_empty` on the host and loaded from the full state dict; fused
  `torch.optim.AdamW` on the offloaded (host) parameters; `clip_grad_norm_`. On a CPU device the offload
  policy cannot pin (pinning needs an accelerator), so it runs with pin_memory=False and the row says so;
- `deepspeed`: ZeRO-3 with offload_param and offload_optimizer to pinned host memory, bf16, DeepSpeedCPUAdam
  (AdamW mode), DeepSpeed's own gradient clipping. Optional (`pip install -e '.[peers]'`); without it, or
  without CUDA, the row is recorded as skipped with the reason.
Both peers checkpoint every block's activations (apply_execution, checkpoint_blocks): the engine recomputes
every streamed block too, so all rows do the same recompute work. Every row starts from `VideoDiT(model)` built
under train.seed (the weights `Trainer` builds); `init_weight_sum` (the float64 sum of every parameter as the
row loaded it) shows it. Every row trains on one fixed batch, `make_batch(dataset, tokenizer, train, 0)`
(the clips, captions, timesteps and noise of train.py's step 0), at the constant rate train.lr, with the loss
`flow_matching_loss` defines.

Step 0 is the check: its loss must be finite and within `loss_rtol` of ours, and its gradient norm within
`grad_norm_rtol` of ours, else the row fails with both values and is not timed. At adaLN-Zero
initialisation the output layer is zero, so the step-0 loss is the same for any weights (it checks the batch
and the loss function); the gradient norm depends on every block and checks the weights. Then warm-up steps,
then `timed_steps` steps timed one by one (megaslide/perf/timing.timed: median, min, max, std). Every step's
loss and gradient norm is recorded; a non-finite one fails the row. MFU counts model FLOPs only
(megaslide/perf/flops.py) against the bf16 matmul peak measured in this run and the H200 datasheet; each row
also gives its step time over ours, its peak HBM and its peak host RSS.
JSON: results/offload_peers/<name>.json (or $MEGASLIDE_RESULTS_DIR), rewritten after every row; W&B run beside it.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import resource
import socket
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from experiments.harness import ExperimentRun, progress
from experiments.hydra_config import RUN_GROUPS, run_config, script_main, trial_preset
from experiments.step_runs import NON_FINITE, non_finite, run_isolated
from megaslide.config import RunConfig, from_dict
from megaslide.data.build import build_dataset
from megaslide.device import resolve_device
from megaslide.diffusion.batches import Batch, make_batch
from megaslide.diffusion.flow import flow_matching_loss
from megaslide.models.chunking import apply_execution
from megaslide.models.dit import VideoDiT, count_params
from megaslide.perf.timing import MIN_REPEATS, matmul_tflops, timed
from megaslide.models.text import HashTokenizer
from megaslide.perf.flops import H200_DATASHEET_BF16_TFLOPS, dit_flops, mfu
from megaslide.perf.memory import peak_hbm_bytes, reset_peak_hbm
from megaslide.train.trainer import Trainer

GB = 1e9
PEERS = ("fsdp2", "deepspeed")
DEEPSPEED_INSTALL = "pip install -e '.[peers]'  (DeepSpeed 0.19.8, pyproject.toml's `peers` extra)"
SMOKE = {"model": {"preset": "tiny", "depth": 2, "in_channels": 3}, "data": {"frames": 4, "height": 16, "width": 16},
         "train": {"device": "cpu"}, "warmup_steps": 1, "matmul_n": 128}


@dataclass
class PeersConfig:
    """offload_peers.yaml's own keys (beside the RunConfig groups of train.yaml)."""

    name: str
    smoke: bool
    peers: list[str]
    warmup_steps: int      # untimed steps per row; the first is the step-0 check
    timed_steps: int
    loss_rtol: float       # step-0 loss of a peer against ours
    grad_norm_rtol: float  # step-0 gradient norm of a peer against ours
    matmul_n: int
    row_time_limit_s: float

    def validate(self) -> None:
        if self.timed_steps < MIN_REPEATS:
            raise ValueError(f"timed_steps={self.timed_steps}: time at least {MIN_REPEATS} steps per row for a median "
                             f"and a spread; set timed_steps={MIN_REPEATS} or more")
        if self.warmup_steps < 1:
            raise ValueError(f"warmup_steps={self.warmup_steps}: at least 1 (step 0 is the loss check, never timed)")
        unknown = sorted(set(self.peers) - set(PEERS))
        if unknown or len(set(self.peers)) != len(self.peers):
            raise ValueError(f"peers={self.peers}: give each of {list(PEERS)} at most once")
        for key in ("loss_rtol", "grad_norm_rtol", "row_time_limit_s"):
            if not 0 < getattr(self, key) < math.inf:
                raise ValueError(f"{key}={getattr(self, key)} must be a positive finite number")
        if self.matmul_n < 1:
            raise ValueError(f"matmul_n={self.matmul_n} must be at least 1 (8192 measures the bf16 peak)")


@dataclass(frozen=True)
class RowSpec:
    """What a row's process needs: the peer, the run and the step-0 values of ours to check against."""

    peer: str
    run: RunConfig
    warmup_steps: int
    timed_steps: int
    reference: dict | None     # ours' step0_loss and step0_grad_norm; None for ours (or when ours failed)
    loss_rtol: float
    grad_norm_rtol: float


# ---- the rows: each builds its trainer and returns a step function --------------------------------------------------
def source_model(run: RunConfig) -> VideoDiT:
    """`VideoDiT(run.model)` built on the host under train.seed: the initial weights `Trainer` builds."""
    torch.manual_seed(run.train.seed)
    return VideoDiT(run.model)


def weight_sum(tensors) -> float:
    """The float64 sum of every element: one number that shows two rows loaded the same weights."""
    return math.fsum(t.detach().double().sum().item() for t in tensors)


def _one_rank_group(device: torch.device) -> None:
    """A 1-rank process group (NCCL on CUDA, gloo on the CPU), set up through the environment as torchrun
    would, so that DeepSpeed finds it too."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)


def _peer_model(run: RunConfig) -> tuple[VideoDiT, VideoDiT]:
    """(the source model, an unallocated meta-device model with every block's activations checkpointed)."""
    source = source_model(run)
    with torch.device("meta"):
        model = apply_execution(VideoDiT(run.model), dataclasses.replace(run.execution, checkpoint_blocks=True))
    return source, model


def build_ours(run: RunConfig, device: torch.device):
    trainer = Trainer(run.model, run.data, run.train, tempfile.gettempdir(), offload_cfg=run.offload,
                      execution=run.execution)     # writes nothing: no step here checkpoints
    engine = trainer.engine

    def step(batch: Batch):
        out = engine.train_step(batch, run.train.lr)
        return out["loss"], out["grad_norm"]
    setup = (f"OffloadEngine via Trainer: overlap={run.offload.overlap}, optimizer on {run.offload.optimizer_device}, "
             f"resident_blocks={run.offload.resident_blocks}, block weights {engine.param_dtype}")
    return step, weight_sum(engine.model_state_dict().values()), setup, engine.flush


def build_fsdp2(run: RunConfig, device: torch.device):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    _one_rank_group(device)
    source, model = _peer_model(run)
    pin = device.type == "cuda"    # pinning needs an accelerator
    policy = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
              "offload_policy": CPUOffloadPolicy(pin_memory=pin)}
    for block in model.blocks:
        fully_shard(block, **policy)
    fully_shard(model, **policy)
    model.to_empty(device="cpu")                         # offloaded parameters live on the host
    set_model_state_dict(model, source.state_dict(), options=StateDictOptions(full_state_dict=True))
    del source
    optimizer = torch.optim.AdamW(model.parameters(), lr=run.train.lr, betas=run.train.betas,
                                  weight_decay=run.train.weight_decay, fused=True)
    clip = run.train.grad_clip if run.train.grad_clip > 0 else math.inf

    def step(batch: Batch):
        loss = flow_matching_loss(model, batch.x0, batch.context, batch.t, batch.noise, batch.mask)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach(), norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    setup = (f"fully_shard per block + root, 1 rank; CPUOffloadPolicy(pin_memory={pin})"
             f"{'' if pin else ' (no accelerator to pin for)'}; MixedPrecisionPolicy(bf16 params, fp32 reduce); "
             f"fused AdamW on the host; activation checkpointing per block")
    return step, weight_sum(p.to_local() for p in model.parameters()), setup, lambda: None


def deepspeed_missing(device: torch.device) -> str | None:
    """Why the DeepSpeed row cannot run here, or None."""
    if importlib.util.find_spec("deepspeed") is None:
        return f"deepspeed is not installed; install it with {DEEPSPEED_INSTALL}"
    if device.type != "cuda":
        return "DeepSpeed ZeRO-3 offload needs a CUDA device"
    return None


def build_deepspeed(run: RunConfig, device: torch.device):
    import deepspeed
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    _one_rank_group(device)
    source, _ = _peer_model(run)
    model = apply_execution(source, dataclasses.replace(run.execution, checkpoint_blocks=True))
    init_sum = weight_sum(model.parameters())
    pinned_cpu = {"device": "cpu", "pin_memory": True}
    config = {"train_micro_batch_size_per_gpu": run.train.batch_size, "gradient_accumulation_steps": 1,
              "gradient_clipping": run.train.grad_clip, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 3, "offload_param": pinned_cpu, "offload_optimizer": pinned_cpu}}
    optimizer = DeepSpeedCPUAdam(model.parameters(), lr=run.train.lr, betas=run.train.betas,
                                 weight_decay=run.train.weight_decay, adamw_mode=True)   # compiles on first use
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

    def step(batch: Batch):
        loss = flow_matching_loss(engine, batch.x0, batch.context, batch.t, batch.noise, batch.mask)
        engine.backward(loss)
        engine.step()
        norm = engine.get_global_grad_norm()   # None where DeepSpeed computed none: recorded as nan, the row fails
        return loss.detach(), torch.tensor(math.nan if norm is None else float(norm))
    setup = ("ZeRO-3, offload_param + offload_optimizer to pinned host memory, bf16, DeepSpeedCPUAdam (AdamW), "
             "DeepSpeed gradient clipping; activation checkpointing per block")
    return step, init_sum, setup, lambda: None


BUILDERS = {"ours": build_ours, "fsdp2": build_fsdp2, "deepspeed": build_deepspeed}


# ---- one row, in its own process ----------------------------------------------------------------------------------
def fixed_batch(run: RunConfig, device: torch.device) -> Batch:
    """train.py's step-0 batch (clips, captions, timesteps, noise), the same in every row."""
    dataset = build_dataset(run.data, in_channels=run.model.in_channels)
    tokenizer = HashTokenizer(run.model.vocab_size, run.model.text_len)
    return make_batch(dataset, tokenizer, run.train, 0).to(device)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def step0_check(spec: RowSpec, loss: float, norm: float) -> dict:
    """The step-0 fields of a row; `step0_match` False fails the row (None: ours gave nothing to check against)."""
    out = {"step0_loss": loss, "step0_grad_norm": norm}
    finite = math.isfinite(loss) and math.isfinite(norm)
    if spec.reference is None:
        return {**out, "step0_match": None if spec.peer != "ours" else finite}
    ref_loss, ref_norm = spec.reference["step0_loss"], spec.reference["step0_grad_norm"]
    loss_rel, norm_rel = _rel(loss, ref_loss), _rel(norm, ref_norm)
    return {**out, "step0_loss_ours": ref_loss, "step0_grad_norm_ours": ref_norm, "step0_loss_rel_diff": loss_rel,
            "step0_grad_norm_rel_diff": norm_rel,
            "step0_match": finite and loss_rel <= spec.loss_rtol and norm_rel <= spec.grad_norm_rtol}


def run_row(spec: RowSpec) -> dict:
    """Build the row's trainer, check step 0, warm up and time; the row's result fields."""
    device = resolve_device(spec.run.train.device, key="train.device")
    reset_peak_hbm(device)
    batch = fixed_batch(spec.run, device)
    t0 = time.perf_counter()
    step, init_sum, setup, flush = BUILDERS[spec.peer](spec.run, device)
    row = {"setup": setup, "build_s": time.perf_counter() - t0, "init_weight_sum": init_sum}
    recorded: list[tuple[torch.Tensor, torch.Tensor]] = []

    def one_step() -> None:
        recorded.append(step(batch))

    def values() -> dict:
        flush()
        pairs = [torch.stack([loss.float().cpu(), norm.float().cpu()]).tolist() for loss, norm in recorded]
        return {"losses": [p[0] for p in pairs], "grad_norms": [p[1] for p in pairs]}

    try:
        one_step()
        first = values()
        row.update(step0_check(spec, first["losses"][0], first["grad_norms"][0]))
        if row["step0_match"] is False:
            return {**row, **first, "status": "failed", "error": "step 0 does not match ours (not timed)"}
        timing = timed(one_step, device, repeats=spec.timed_steps, warmup=spec.warmup_steps - 1)
        row.update(values())
    except FloatingPointError as err:          # ours refuses a non-finite step itself
        return {**row, **non_finite(err, [loss.item() for loss, _ in recorded])}
    bad = [i for i, v in enumerate(row["losses"] + row["grad_norms"]) if not math.isfinite(v)]
    if bad:
        return {**row, "status": NON_FINITE, "error": f"step {bad[0] % len(row['losses'])} is not finite"}
    return {**row, "status": "ok", "timed_steps": len(timing.times), "step_s": timing.median,
            "step_s_min": timing.min, "step_s_max": timing.max, "step_s_std": timing.std,
            "peak_hbm_GB": peak_hbm_bytes(device) / GB,
            "host_peak_rss_GB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB}


def _row_process(spec: RowSpec, queue) -> None:
    try:
        queue.put(run_row(spec))
    except torch.OutOfMemoryError as err:
        queue.put({"status": "OOM", "error": str(err).splitlines()[0][:300]})
    except Exception as err:  # noqa: BLE001 - any failure of a peer's stack is that row's result
        queue.put({"status": "error", "error": f"{type(err).__name__}: {err}"[:300]})


# ---- the table ----------------------------------------------------------------------------------------------------
def with_rates(row: dict, flops: float, peak: float, ours: dict | None) -> dict:
    """MFU against both peaks, achieved TFLOP/s and the step time over ours, for a timed row."""
    if row.get("status") != "ok":
        return row
    s = row["step_s"]
    rates = {"mfu_vs_measured_peak": mfu(flops, s, peak), "mfu_vs_datasheet": mfu(flops, s, H200_DATASHEET_BF16_TFLOPS),
             "achieved_TFLOPs": flops / s / 1e12}
    if ours is not None and ours.get("status") == "ok":
        rates["step_s_vs_ours"] = s / ours["step_s"]
    return {**row, **rates}


def print_table(p: dict) -> None:
    print(f"\noffload_peers  device={p['device']}  {p['preset']} depth {p['depth']} "
          f"({p['params'] / 1e9:.2f} B params), "
          f"{p['tokens']} tokens x batch {p['batch']}; matmul {p['ceilings']['matmul_TFLOPs']:.1f} TFLOP/s")
    print(f"{'row':<10} {'status':<16} {'step s':>8} {'min':>8} {'max':>8} {'MFU meas':>8} {'MFU ds':>7} "
          f"{'vs ours':>7} {'HBM GB':>7} {'RSS GB':>7}  step-0 loss / grad norm")
    for r in p["rows"]:
        if r["status"] != "ok":
            why = r.get("reason") or r.get("error") or r.get("phase", "")
            print(f"{r['peer']:<10} {r['status']:<16} {why}")
            continue
        ratio = f"{r['step_s_vs_ours']:.2f}" if "step_s_vs_ours" in r else "-"
        print(f"{r['peer']:<10} {r['status']:<16} {r['step_s']:>8.3f} {r['step_s_min']:>8.3f} {r['step_s_max']:>8.3f} "
              f"{r['mfu_vs_measured_peak']:>8.1%} {r['mfu_vs_datasheet']:>7.1%} {ratio:>7} {r['peak_hbm_GB']:>7.1f} "
              f"{r['host_peak_rss_GB']:>7.1f}  {r['step0_loss']:.5f} / {r['step0_grad_norm']:.5f}")


@script_main("offload_peers")
def main(cfg: DictConfig) -> None:
    c = OmegaConf.to_container(OmegaConf.merge(cfg, trial_preset(cfg, smoke=SMOKE) or {}), resolve=True)
    script = from_dict(PeersConfig, {f.name: c[f.name] for f in dataclasses.fields(PeersConfig)})
    script.validate()
    run = run_config({k: c[k] for k in RUN_GROUPS})         # every check before anything is built
    device = resolve_device(run.train.device, key="train.device")
    grid, batch = run.grid, run.train.batch_size
    flops = dit_flops(run.model, batch, grid).train
    name = script.name or ("smoke" if script.smoke else f"{device.type}_{c['model']['preset']}_d{run.model.depth}")
    config = {**{k: c[k] for k in RUN_GROUPS}, **dataclasses.asdict(script)}
    experiment = ExperimentRun("offload_peers", name, config, c["wandb"]["dir"], c["wandb"]["project"],
                               trial=script.smoke)

    matmul_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    peak = matmul_tflops(device, n=script.matmul_n, dtype=matmul_dtype)
    progress(f"device {device}; matmul peak {peak:.1f} TFLOP/s ({matmul_dtype})")
    payload = {"device": str(device), "smoke": script.smoke, "preset": c["model"]["preset"], "depth": run.model.depth,
               "params": count_params(run.model), "grid": list(grid), "tokens": math.prod(grid), "batch": batch,
               "model_cfg": dataclasses.asdict(run.model), "run": dataclasses.asdict(run),
               "script": dataclasses.asdict(script), "model_flops_per_step": flops,
               "ceilings": {"matmul_TFLOPs": peak, "matmul_n": script.matmul_n, "matmul_dtype": str(matmul_dtype),
                            "datasheet_TFLOPs": H200_DATASHEET_BF16_TFLOPS},
               "tolerances": {"loss_rtol": script.loss_rtol, "grad_norm_rtol": script.grad_norm_rtol},
               "rows": [], "complete": False}
    ours = None
    for peer in ["ours", *script.peers]:
        reason = deepspeed_missing(device) if peer == "deepspeed" else None
        if reason is not None:
            row = {"status": "skipped", "reason": reason}
            progress(f"{peer}: skipped: {reason}")
        else:
            reference = None if ours is None or "step0_loss" not in ours else \
                {k: ours[k] for k in ("step0_loss", "step0_grad_norm")}
            spec = RowSpec(peer, run, script.warmup_steps, script.timed_steps, reference, script.loss_rtol,
                           script.grad_norm_rtol)
            progress(f"{peer}: building and stepping in a fresh process")
            row = run_isolated(_row_process, (spec,), script.row_time_limit_s)
            progress(f"{peer}: {row['status']}" + (f", step {row['step_s']:.3f} s" if "step_s" in row else
                                                   f" ({row.get('error') or row.get('phase', '')})"))
        row = with_rates({"peer": peer, **row}, flops, peak, ours)
        ours = row if peer == "ours" else ours
        payload["rows"].append(row)
        experiment.save(payload)
    payload["complete"] = True
    headline = {"matmul_TFLOPs": peak, **{f"{r['peer']}/{k}": r[k] for r in payload["rows"]
                                          for k in ("step_s", "mfu_vs_measured_peak", "step_s_vs_ours") if k in r}}
    progress(f"wrote {experiment.finish(payload, headline)}")
    print_table(payload)


if __name__ == "__main__":
    main()
