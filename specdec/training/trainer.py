"""`specdec train eagle3`: train an EAGLE-3 head for a target on distilled data, resumably, on every device.

    specdec train eagle3 --data DIR --out DIR [--target DIR] [--config run.yaml] [--steps N] ...

Writes OUT/checkpoints/step_N/ (specdec.training.checkpoint) every `save_every` steps and at the end,
OUT/head/ (the head in the speculators format vLLM loads, `specdec generate --drafter eagle3=OUT/head`),
OUT/train_log.jsonl (the metrics of every logged step) and, with `eval_rows`, OUT/eval_log.jsonl: the same
metrics over rows held out from training (teacher-forced, every TTT step), every `eval_every` steps. Their
gap to the training metrics is how much the head memorises its data rather than learning the target. A
finished run plots both as OUT/training.png. A run whose OUT already holds a checkpoint of
the same config (TrainConfig.identity) continues from its newest checkpoint, exactly: the parameters after
N steps are the same whether or not the run was killed and resumed in between.

Scale-out. Data parallel over a `jax.sharding.Mesh` with one axis "data": every global batch of
`batch_size` sequences is split over the devices, the head's parameters, optimizer state and the frozen
target are replicated, and XLA all-reduces the gradients. One host uses all its local devices
(`devices` limits them). Several hosts run one process each with the same command and config plus

    --coordinator-address HOST:PORT --num-processes P --process-id I
    (or SPECDEC_COORDINATOR_ADDRESS, SPECDEC_NUM_PROCESSES, SPECDEC_PROCESS_ID in the environment)

which calls `jax.distributed.initialize(coordinator_address, num_processes, process_id)` before anything
touches a device; the mesh then spans every host's devices, each process reads only its slice of each
global batch (`jax.make_array_from_process_local_data`), and process 0 alone writes checkpoints, the
head and the logs. `batch_size` must be a multiple of the total device count. Every host needs the data
and the target at the given paths.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specdec.errors import SpecdecError
from specdec.training.config import TrainConfig

_distributed = False


@dataclass
class TrainResult:
    step: int  # optimizer steps done
    out: Path
    head: Path | None  # the exported head (None when stopped early)
    checkpoint: Path | None
    metrics: dict  # the last logged metrics
    resumed_from: int  # 0: a fresh run
    devices: int = 1  # in the data-parallel mesh
    eval_metrics: dict = dataclasses.field(default_factory=dict)  # the last evaluation of the held-out rows


def env_multi_host(cfg: TrainConfig) -> TrainConfig:
    """Multi-host settings from the environment where the config leaves them unset."""
    env = {"coordinator_address": ("SPECDEC_COORDINATOR_ADDRESS", str),
           "num_processes": ("SPECDEC_NUM_PROCESSES", int), "process_id": ("SPECDEC_PROCESS_ID", int)}
    values = {}
    for name, (var, kind) in env.items():
        if getattr(cfg, name) is None and os.environ.get(var):
            try:
                values[name] = kind(os.environ[var])
            except ValueError:
                raise SpecdecError(f"{var}={os.environ[var]!r}: expected {kind.__name__}") from None
    return dataclasses.replace(cfg, **values)


def init_distributed(cfg: TrainConfig) -> None:
    global _distributed
    if cfg.coordinator_address is None or _distributed:
        return
    import jax

    jax.distributed.initialize(coordinator_address=cfg.coordinator_address, num_processes=cfg.num_processes,
                               process_id=cfg.process_id)
    _distributed = True


def train_eagle3(cfg: TrainConfig, resume: bool = False, stop_after: int | None = None, console=None,
                 progress: bool = True) -> TrainResult:
    """Train (or continue) the run `cfg` describes. `resume` insists on a checkpoint to continue from (one of
    the same config is continued anyway). `stop_after` ends the loop after that many optimizer steps in all,
    as a kill would (saving only on the usual schedule; no head exported)."""
    cfg = env_multi_host(cfg)
    cfg.check()
    init_distributed(cfg)

    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import specdec.compile_cache as compile_cache
    from specdec.drafters.eagle3 import Eagle3Config, build_draft_vocab, default_aux_layer_ids, save_head
    from specdec.models import gemma_jax
    from specdec.models.checkpoint import checkpoint_fingerprint
    from specdec.models.config import GemmaConfig
    from specdec.models.gguf_import import resolve_checkpoint
    from specdec.training import checkpoint as ckpts
    from specdec.training import eagle3 as train
    from specdec.training.data import Prefetcher, TrainData

    compile_cache.enable_jax()
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise SpecdecError(f"{out}: exists and is not a directory")
    target_path = resolve_checkpoint(cfg.target)
    tcfg = GemmaConfig.from_file(target_path / "config.json")
    fingerprint = checkpoint_fingerprint(target_path)
    data = TrainData(cfg.data, cfg.offline, cfg.eval_rows, cfg.seed)
    data.check_target(fingerprint, tcfg.vocab_size, tcfg.hidden_size)

    aux = tuple(cfg.aux_layer_ids or (data.manifest.aux_layer_ids if cfg.offline else None)
                or default_aux_layer_ids(tcfg.num_layers))
    if cfg.offline and data.manifest.aux_layer_ids and tuple(data.manifest.aux_layer_ids) != aux:
        raise SpecdecError(f"{cfg.data}: features were captured at aux layers {list(data.manifest.aux_layer_ids)}, "
                           f"the head fuses {list(aux)} (train online, or distill again with --aux-layers)")
    default_dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    resolved = dataclasses.replace(
        cfg, target=str(target_path), data=str(Path(cfg.data).resolve()), out=str(out.resolve()),
        aux_layer_ids=list(aux), draft_vocab_size=min(cfg.draft_vocab_size, tcfg.vocab_size),
        compute_dtype=cfg.compute_dtype or default_dtype, target_dtype=cfg.target_dtype or default_dtype)
    cfg = resolved
    # P-EAGLE's mask rows read the target's pad token (any id does: its embedding is frozen, the mask feature learned)
    head_cfg = Eagle3Config.for_target(tcfg, resolved.draft_vocab_size, aux, fingerprint,
                                       mask_token_id=tcfg.pad_token_id if cfg.parallel_drafting else None)

    # -- devices ----------------------------------------------------------------------------------------
    if jax.process_count() > 1:
        devices = jax.devices()
    else:
        devices = jax.local_devices()
        if cfg.devices is not None:
            if cfg.devices > len(devices):
                raise SpecdecError(f"--devices {cfg.devices}: only {len(devices)} {devices[0].platform} devices here")
            devices = devices[: cfg.devices]
    if cfg.batch_size % len(devices):
        raise SpecdecError(f"--batch-size {cfg.batch_size} is not a multiple of the {len(devices)} devices")
    mesh = train.data_mesh(devices)
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    lead = jax.process_index() == 0

    # -- state: a checkpoint of this run, or a fresh head -----------------------------------------------
    tx, schedule = train.make_optimizer(resolved)
    existing = ckpts.latest_checkpoint(out)
    start = 0
    if existing is not None:
        ckpt = ckpts.read_checkpoint(existing)
        diffs = resolved.differences(ckpt.config)
        if diffs:
            raise SpecdecError(f"{out} holds a checkpoint of another run ({'; '.join(diffs[:3])}): pass another --out, "
                               "or the same settings to continue it")
        if ckpt.target_fingerprint and ckpt.target_fingerprint != fingerprint:
            raise SpecdecError(f"{existing}: trained for target {ckpt.target_fingerprint}, this target is {fingerprint}")
        if ckpt.head_cfg != head_cfg:
            raise SpecdecError(f"{existing}: head config differs from this run's")
        if ckpt.data_rows and ckpt.data_rows != data.num_rows:
            raise SpecdecError(f"{existing}: trained on {ckpt.data_rows} rows of {cfg.data}, which now holds {data.num_rows}")
        if ckpt.data_position != ckpt.step * cfg.batch_size:
            raise SpecdecError(f"{existing}: data position {ckpt.data_position} does not match step {ckpt.step}")
        start, d2t, t2d = ckpt.step, ckpt.d2t, ckpt.t2d
        params = {k: jnp.asarray(v) for k, v in ckpt.params.items()}
        state = train.create_state(params, tx)
        state = state.replace(opt_state=ckpts.restore_opt_state(ckpt, state.opt_state))
    elif resume:
        raise SpecdecError(f"--resume: no checkpoint in {out}")
    else:
        d2t, t2d = build_draft_vocab(data.response_token_counts(tcfg.vocab_size), head_cfg.draft_vocab_size)
        state = train.create_state(train.init_head_params(head_cfg, cfg.seed), tx)
    state = state.replace(step=jnp.asarray(start, jnp.int32))
    state = jax.device_put(state, replicated)
    vocab = jax.device_put(train.loss_vocab(d2t, t2d), replicated)

    def save(step: int) -> Path | None:
        if not lead:
            return None
        return ckpts.save_checkpoint(out, step, state.params, state.opt_state, d2t, t2d, head_cfg, resolved,
                                     step * cfg.batch_size, cfg.keep, data.num_rows)

    def export() -> Path | None:
        if not lead:
            return None
        params = {k: ckpts.host_array(v) for k, v in state.params.items()}
        return save_head(out / "head", head_cfg, params, d2t, t2d)

    stop = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
    if start >= stop:
        head = export() if start >= cfg.steps else None
        return TrainResult(start, out, head, existing, {}, start, len(devices))

    # -- the target and the compiled step --------------------------------------------------------------
    _, tparams = gemma_jax.load_params(target_path, jnp.dtype(cfg.target_dtype))
    if cfg.offline:  # the layers are not needed: only the embedding, the final norm and the LM head
        keep = {"embed_tokens.weight", "norm.weight", "lm_head.weight"}
        tparams = {k: v for k, v in tparams.items() if k in keep}
    tparams = jax.device_put(tparams, replicated)
    settings = train.LossSettings(ttt_steps=cfg.ttt_steps, step_weight_decay=cfg.step_weight_decay,
                                  online=not cfg.offline, compute_dtype=cfg.compute_dtype)
    step_fn = train.make_train_step(head_cfg, tcfg, settings, schedule, mesh)

    nproc, pid = jax.process_count(), jax.process_index()
    local = cfg.batch_size // nproc

    def host_batch(step: int) -> dict:
        rows = data.rows_of_step(cfg.seed, step, cfg.batch_size)[pid * local:(pid + 1) * local]
        return data.batch(rows, cfg.seq_len, tcfg.pad_token_id)

    def device_batch(host: dict) -> dict:
        return {k: jax.make_array_from_process_local_data(split, v, (cfg.batch_size, *v.shape[1:]))
                for k, v in host.items() if k != "valid"}

    eval_loss = train.make_eval_loss(head_cfg, tcfg, settings, mesh) if len(data.eval_index) else None
    eval_every = cfg.eval_every or cfg.save_every

    def evaluate(step: int) -> dict:
        per_batch = []
        for rows in data.eval_batches(cfg.batch_size):
            host = data.batch(rows[pid * local:(pid + 1) * local], cfg.seq_len, tcfg.pad_token_id)
            _, metrics = eval_loss(state.params, tparams, vocab, device_batch(host))
            per_batch.append({k: ckpts.host_array(v) for k, v in metrics.items()})
        return monitor.log_eval(step, held_out_metrics(per_batch, settings.step_weights))

    monitor = Monitor(resolved, out, start, cfg.steps, lead, console, progress, resumed=existing is not None)
    prefetch = Prefetcher(host_batch, start, stop)
    last_metrics: dict = {}
    last_eval: dict = {}
    checkpoint = existing
    step = start
    try:
        for step in range(start + 1, stop + 1):
            host = prefetch.get(step - 1)
            state, metrics = step_fn(state, tparams, vocab, device_batch(host))
            if step == start + 1:
                monitor.compiled()
            monitor.advance(int(host["valid"].sum()) * nproc)
            if step % cfg.log_every == 0 or step == cfg.steps:
                last_metrics = monitor.log(step, {k: ckpts.host_array(v) for k, v in metrics.items()})
            if eval_loss is not None and (step % eval_every == 0 or step == cfg.steps):
                last_eval = evaluate(step)
            if step % cfg.save_every == 0 or step == cfg.steps:
                checkpoint = save(step)
    finally:
        prefetch.close()
        monitor.close()
    head = None
    if step >= cfg.steps:
        head = export()
        if lead:
            from specdec.training.report import plot_training_log

            plot_training_log(monitor.log_path, out / "training.png",
                              f"EAGLE-3 head for {target_path.name} · {cfg.steps} steps of {cfg.batch_size} x {cfg.seq_len} tokens")
    return TrainResult(step, out, head, checkpoint, last_metrics, start, len(devices), last_eval)


def evaluate_head(head_dir: str | Path, data_dir: str | Path, target: str | Path | None = None, batch_size: int = 32,
                  seq_len: int = 384, ttt_steps: int = 7, dtype: str | None = None) -> dict:
    """Teacher-forced metrics of an exported EAGLE-3 head over every row of a distilled dataset, computed as
    training's held-out evaluation computes them (held_out_metrics' keys; the target's JAX forward gives the
    features). The data may come from any prompts, e.g. the target's answers to the prompts a head is
    benchmarked on: how well it predicts the text it drafts for, apart from how drafting turns that into
    acceptance."""
    import jax
    import jax.numpy as jnp

    import specdec.compile_cache as compile_cache
    from specdec.drafters.eagle3 import load_for_target
    from specdec.models import gemma_jax
    from specdec.models.checkpoint import checkpoint_fingerprint
    from specdec.models.config import GemmaConfig
    from specdec.models.gguf_import import resolve_checkpoint
    from specdec.training import eagle3 as train
    from specdec.training.data import TrainData

    for name, value in (("batch size", batch_size), ("seq len", seq_len), ("ttt steps", ttt_steps)):
        if value < 1:
            raise SpecdecError(f"{name} must be >= 1, got {value}")
    compile_cache.enable_jax()
    target_path = resolve_checkpoint(target)
    tcfg = GemmaConfig.from_file(target_path / "config.json")
    fingerprint = checkpoint_fingerprint(target_path)
    head = load_for_target(head_dir, tcfg, fingerprint)
    data = TrainData(data_dir)
    data.check_target(fingerprint, tcfg.vocab_size, tcfg.hidden_size)
    dtype = dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")  # as training defaults them
    _, tparams = gemma_jax.load_params(target_path, jnp.dtype(dtype))
    settings = train.LossSettings(ttt_steps=ttt_steps, compute_dtype=dtype)
    loss_fn = train.make_eval_loss(head.cfg, tcfg, settings, train.data_mesh(jax.local_devices()[:1]))
    params = {k: jnp.asarray(v) for k, v in head.params.items()}
    vocab = train.loss_vocab(head.d2t, head.t2d)
    per_batch = []
    for rows in data.padded_batches(np.arange(data.num_rows), batch_size):
        batch = {k: v for k, v in data.batch(rows, seq_len, tcfg.pad_token_id).items() if k != "valid"}
        _, metrics = loss_fn(params, tparams, vocab, batch)
        per_batch.append({k: np.asarray(v) for k, v in metrics.items()})
    return held_out_metrics(per_batch, settings.step_weights)


def held_out_metrics(per_batch: list[dict], step_weights) -> dict:
    """The loss metrics of the held-out batches combined as over one batch of all their rows: per TTT step j,
    eval_loss_j and eval_acc_j (as the training's loss_j and acc_j), eval_count_j, and eval_coverage_j (the
    share of predicted tokens whose target argmax lies in the draft vocabulary: the rest no head can draft);
    eval_loss weighted over the steps as the training loss is."""
    count = sum(np.asarray(m["step_count"], np.float64) for m in per_batch)
    total = sum(np.asarray(m["step_total"], np.float64) for m in per_batch)
    loss = sum(np.asarray(m["step_loss"], np.float64) * m["step_count"] for m in per_batch) / np.maximum(count, 1)
    acc = sum(np.asarray(m["step_acc"], np.float64) * m["step_count"] for m in per_batch) / np.maximum(count, 1)
    flat = {"eval_loss": float(np.dot(step_weights, loss))}
    for j in range(len(count)):
        flat[f"eval_loss_{j}"], flat[f"eval_acc_{j}"] = float(loss[j]), float(acc[j])
        flat[f"eval_count_{j}"], flat[f"eval_coverage_{j}"] = int(count[j]), float(count[j] / max(total[j], 1))
    return flat


class Monitor:
    """Progress bar (rich, on stderr), OUT/train_log.jsonl and, when configured, Weights & Biases (imported
    only then). Only the lead process reports. Metrics reach the host only at logged steps."""

    def __init__(self, cfg: TrainConfig, out: Path, start: int, total: int, lead: bool, console, progress: bool,
                 resumed: bool):
        self.lead, self.out = lead, out
        self.bar = self.task = self.run = None
        self.tokens = 0
        self.since = time.perf_counter()
        self.held_out = ""  # the last held-out accuracy, shown beside the training metrics
        if not lead:
            return
        out.mkdir(parents=True, exist_ok=True)
        self.log_path = out / "train_log.jsonl"
        self.eval_path = out / "eval_log.jsonl"
        for path in (self.log_path, self.eval_path):
            if path.is_file():  # a resumed run logs again the steps after its checkpoint
                kept = [line for line in path.read_text().splitlines() if _logged_step(line) <= start]
                path.write_text("".join(line + "\n" for line in kept))
        if progress:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn

            from specdec.progress import LoggedProgress

            console = console or Console(stderr=True)
            if resumed:
                console.print(f"resuming from step {start} of {total} ({out})", highlight=False, soft_wrap=True)
            self.bar = LoggedProgress(TextColumn("eagle3"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                      TimeRemainingColumn(), TextColumn("{task.fields[stats]}"), console=console)
            self.bar.start()
            self.task = self.bar.add_task("train", total=total, completed=start, stats="compiling")
        if cfg.wandb_project:
            self.run = _wandb_init(cfg, out, resumed)

    def compiled(self) -> None:
        """The first step is compiled (and dispatched): tok/s counts from here."""
        self.tokens, self.since = 0, time.perf_counter()
        if self.bar is not None:
            self.bar.update(self.task, stats="running")

    def advance(self, tokens: int) -> None:
        self.tokens += tokens
        if self.bar is not None:
            self.bar.advance(self.task)

    def log(self, step: int, metrics: dict) -> dict:
        now = time.perf_counter()
        tok_s = self.tokens / max(now - self.since, 1e-9)
        self.tokens, self.since = 0, now
        flat = {"loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"]), "lr": float(metrics["lr"]),
                "tok_s": tok_s}
        for j, (loss, acc, count) in enumerate(zip(metrics["step_loss"], metrics["step_acc"], metrics["step_count"])):
            flat[f"loss_{j}"], flat[f"acc_{j}"], flat[f"count_{j}"] = float(loss), float(acc), int(count)
        if not self.lead:
            return flat
        with open(self.log_path, "a") as f:
            f.write(json.dumps({"step": step, **flat}) + "\n")
        if self.bar is not None:
            self.bar.update(self.task, stats=f"loss {flat['loss']:.3f} · acc0 {flat['acc_0']:.3f}{self.held_out} · "
                                             f"{tok_s:,.0f} tok/s")
        if self.run is not None:
            self.run.log({f"train/{k}": v for k, v in flat.items()}, step=step)
        return flat

    def log_eval(self, step: int, flat: dict) -> dict:
        if not self.lead:
            return flat
        with open(self.eval_path, "a") as f:
            f.write(json.dumps({"step": step, **flat}) + "\n")
        self.held_out = f" (held out {flat['eval_acc_0']:.3f})"
        if self.run is not None:
            self.run.log({f"eval/{k.removeprefix('eval_')}": v for k, v in flat.items()}, step=step)
        return flat

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
        if self.run is not None:
            self.run.finish()
            self.run = None


def _logged_step(line: str) -> float:
    """The step of a train_log.jsonl line (a line cut short by a kill: infinity, so it is dropped)."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return float("inf")


def _wandb_init(cfg: TrainConfig, out: Path, resumed: bool):
    """A wandb run; its id is kept in OUT/wandb_id so that a resumed training continues the same run."""
    try:
        import wandb
    except ImportError:
        raise SpecdecError("--wandb-project needs wandb (pip install 'specdec[train]')") from None
    id_file = out / "wandb_id"
    run_id = id_file.read_text().strip() if resumed and id_file.is_file() else None
    try:
        run = wandb.init(project=cfg.wandb_project, mode=cfg.wandb_mode, name=cfg.wandb_run_name,
                         dir=os.environ.get("WANDB_DIR") or str(out), config=cfg.to_dict(), id=run_id,
                         resume="allow" if run_id else None)
    except Exception as e:  # noqa: BLE001 - wandb's errors (network, auth) end the command as one line
        raise SpecdecError(f"wandb: {' '.join(str(e).split())[:300]}") from None
    id_file.write_text(run.id)
    return run
