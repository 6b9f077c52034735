"""`shoal run`: a validated workload -> a Ray Train job, tracked in MLflow."""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from shoal.data import keep_run_tokenizer, training_manifest, validation_manifest
from shoal.data.manifest import Manifest, coarse_row_groups
from shoal.errors import ShoalError
from shoal.launch.cluster import QUIET_ENV, ClusterError, quiet_ray_logging, ray_session
from shoal.launch.interrupts import Interrupted, fit_interruptibly, signals_reach_here
from shoal.launch.retention import BestKeeper
from shoal.launch.storage import Storage, open_storage, probe
from shoal.messages import EventKind, Metric
from shoal.redact import without_credentials_data
from shoal.spec import LoadedWorkload
from shoal.tracking import Observer, Recorder, open_run, resolve_uri
from shoal.tracking.drain import Drainer
from shoal.tracking.driver_watch import DriverWatch
from shoal.tracking.mlflow_run import CWD_TAG, git_commit
from shoal.worker.batching import global_batch_size
from shoal.worker.config import WorkerConfig

log = logging.getLogger("shoal")
REPORT_INTERVAL_S = 3.0
SWEEP_TAG = "shoal.sweep"  # a sweep's trials carry it (launch/tuning.py)
# The step metrics a run's result (and its summary table) shows, beside the evaluations.
RESULT_METRICS = (
    Metric.TRAIN_LOSS,
    Metric.TRAIN_SAMPLES_PER_S,
    Metric.TRAIN_TOKENS_PER_S,
    Metric.PERF_TFLOPS,
    Metric.PERF_MFU,
    Metric.MEMORY_PEAK_MB,
)


@dataclass
class RunOptions:
    address: str | None = None
    run_name: str | None = None
    verbose: bool = False
    report_interval_s: float = REPORT_INTERVAL_S
    tags: dict[str, str] = field(default_factory=dict)  # extra MLflow tags (a sweep's parent run...)
    mlflow_run_id: str | None = None  # an MLflow run made beforehand (shoal submit, sweep trials)
    init_from: str | None = None  # a checkpoint of another run to start from (PBT exploits)
    dashboard: bool = False  # a local Ray with the dashboard (Tune needs it to free placement groups)


@dataclass
class RunResult:
    status: str  # FINISHED | FAILED | KILLED (MLflow's words)
    run_name: str
    run_dir: str
    run_id: str
    experiment: str
    tracking_uri: str
    step: int = 0
    total_steps: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    checkpoint: str | None = None
    restarts: int = 0
    resumed_from: int | None = None
    reason: str | None = None
    unsent_writes: int = 0  # MLflow writes lost to an unreachable tracking store
    model_uri: str | None = None  # the final model in MLflow (tracking.log_model)
    model_error: str | None = None  # why it could not be logged (the training itself succeeded)

    @property
    def ok(self) -> bool:
        return self.status == "FINISHED"


def ray_job_tags() -> dict[str, str]:
    """The Ray job this driver runs in, when `shoal submit` started it."""
    config = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    job_id = json.loads(config).get("metadata", {}).get("job_submission_id") if config else None
    return {"shoal.ray_job_id": job_id} if job_id else {}


def default_run_name(workload_name: str) -> str:
    return f"{workload_name}-{time.strftime('%Y%m%d-%H%M%S')}"


def _threads_per_worker(scaling: Any) -> int:
    if scaling.threads_per_worker:
        return scaling.threads_per_worker
    return max(1, (os.cpu_count() or 1) // scaling.worker_range()[1])


def _worker_config(
    loaded: LoadedWorkload, run_dir: Path, options: RunOptions, manifest: Manifest, own_latest: str | None
) -> WorkerConfig:
    assert loaded.data is not None
    val = validation_manifest(loaded.data)
    return WorkerConfig(
        workload=loaded.workload,
        task=loaded.data.task,
        run_dir=str(run_dir),
        report_interval_s=options.report_interval_s,
        threads_per_worker=_threads_per_worker(loaded.workload.scaling),
        train_manifest=manifest.to_json(),
        val_manifest=val.to_json() if val else "",
        keep_val=loaded.data.cache,
        sys_path=(os.getcwd(),),
        audit_samples=os.environ.get("SHOAL_AUDIT_SAMPLES") == "1",
        init_from=options.init_from,
        own_latest=own_latest,
    )


def _trainer(
    loaded: LoadedWorkload, run_name: str, storage: Storage, config: WorkerConfig, queue: Any, local: bool
):
    # deferred: Ray loads when a run starts; `shoal submit` and `runs show` import launch/, start none
    import ray.train
    from ray.train.torch import TorchTrainer

    from shoal.tracking.bridge import ControllerAnnouncer, ForwardingCallback
    from shoal.worker.loop import train

    w = loaded.workload
    low, high = w.scaling.worker_range()
    # Read by Ray Train's controller, which gets the driver's value at fit().
    os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = str(w.failure.worker_start_timeout_s)
    resources = {"CPU": w.scaling.cpus_per_worker}
    if w.scaling.gpus_per_worker:
        resources["GPU"] = w.scaling.gpus_per_worker
    run_config = ray.train.RunConfig(
        name=run_name,
        storage_path=storage.path,
        storage_filesystem=storage.filesystem,
        failure_config=ray.train.FailureConfig(max_failures=w.failure.max_restarts),
        checkpoint_config=ray.train.CheckpointConfig(num_to_keep=w.checkpoint.keep),
        callbacks=[ForwardingCallback(queue), ControllerAnnouncer(queue)],
        worker_runtime_env=None if local else {"env_vars": dict(QUIET_ENV)},
    )
    return TorchTrainer(
        train,
        train_loop_config=config.as_train_loop_config(),
        scaling_config=ray.train.ScalingConfig(
            num_workers=low if low == high else (low, high),
            elastic_resize_monitor_interval_s=w.scaling.resize_interval_s,
            use_gpu=bool(w.scaling.gpus_per_worker),
            resources_per_worker=resources,
        ),
        run_config=run_config,
    )  # no Ray datasets: each worker reads its own share of the data (worker/stream.py, steps.py)


def _check_resources(loaded: LoadedWorkload, session: Any) -> None:
    # deferred: Ray loads when a run starts; `shoal submit` and `runs show` import launch/, start none
    import ray

    gpus = loaded.workload.scaling.gpus_per_worker
    if gpus and session.started_here and not ray.cluster_resources().get("GPU"):
        raise ClusterError(
            f"scaling.gpus_per_worker is {gpus} but this machine has no GPU visible to Ray; "
            "set scaling.gpus_per_worker: 0 to train on CPU"
        )


def report_queue() -> Any:
    """The queue from Ray Train's controller to the driver, on the driver's node (where
    Ray Train pins the controller too): anywhere else, losing that node would end the run."""
    # deferred like every Ray import here: `shoal submit` and `runs show` start no Ray
    import ray
    from ray.util.queue import Queue
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return Queue(actor_options={"num_cpus": 0, "scheduling_strategy": here})


def failure_reason(exc: BaseException) -> str:
    failures = getattr(exc, "worker_failures", None)
    if failures:
        rank, error = sorted(failures.items())[0]
        first = str(error).strip().splitlines()
        return f"worker rank {rank}: {type(error).__name__}: {first[-1] if first else ''}"
    lines = str(exc).strip().splitlines()
    return lines[-1] if lines else type(exc).__name__


STORAGE_ERRORS = (
    "No space left on device",
    "Read-only file system",
    "Permission denied",
    "Disk quota exceeded",
)


def storage_hint(reason: str, storage: Storage) -> str:
    """Name the checkpoint storage when that is what failed: the raw error rarely says where."""
    if any(text.lower() in reason.lower() for text in STORAGE_ERRORS):
        return f"checkpoint storage {storage.uri}: {reason}"
    return reason


def run(
    loaded: LoadedWorkload, options: RunOptions | None = None, observer: Observer | None = None
) -> RunResult:
    """Train a workload to completion (or failure); resumes a run name that has checkpoints."""
    # deferred: Ray loads when a run starts; `shoal submit` and `runs show` import launch/, start none
    from ray.train import TrainingFailedError

    options = options or RunOptions()
    w = loaded.workload
    run_name = options.run_name or default_run_name(w.name)
    storage = open_storage(w.checkpoint.storage, w.checkpoint.endpoint)
    run_dir = storage.local_run_dir(run_name)
    probe(storage)
    quiet_ray_logging(run_dir / "logs" / "driver.log", options.verbose)
    if own_latest := storage.set_aside_unreadable_record(run_name):
        log.warning(
            "Ray Train's record of the checkpoints in %s was cut short (a full disk?); it is set "
            "aside and the run resumes from the newest intact checkpoint there that MLflow has "
            "every step up to",
            storage.run_uri(run_name),
        )
    loaded = replace(loaded, data=keep_run_tokenizer(loaded.data, run_dir, log.info))  # raw text
    manifest = training_manifest(loaded.data)
    micro, global_batch = w.data.batch_size, global_batch_size(w)
    if coarse := coarse_row_groups(manifest, micro, global_batch, w.data.shuffle_buffer):
        log.warning("%s", coarse)
    experiment = w.tracking.experiment or w.name
    uri = resolve_uri(w.tracking.uri)
    cpus = w.scaling.worker_range()[1] * w.scaling.cpus_per_worker
    with ray_session(options.address, cpus, options.verbose, options.dashboard) as session:
        _check_resources(loaded, session)
        tags = {"shoal.workload": w.name, "shoal.ray_address": session.address, CWD_TAG: os.getcwd()}
        tags.update(ray_job_tags())
        tags.update(options.tags)
        if commit := git_commit():
            tags["shoal.git_commit"] = commit
        resolved = w.resolved()
        tracked = open_run(
            uri,
            experiment,
            run_name,
            run_dir=storage.run_uri(run_name),
            resume=bool(storage.checkpoints(run_name)),
            resolved_spec=resolved,
            spec_yaml=yaml.safe_dump(without_credentials_data(resolved), sort_keys=False),
            tags=tags,
            run_id=options.mlflow_run_id,
        )
        if tracked.taken_over_from:
            log.warning(
                "MLflow run %s was left %s by a driver that stopped before its first checkpoint; "
                "this run continues it, training again from step 0 (steps it logged are not logged twice)",
                tracked.run_id,
                tracked.taken_over_from,
            )
        if own_latest and tracked.resumed:  # a newer checkpoint than MLflow has steps for leaves a gap
            own_latest = _without_gap(storage, run_name, tracked.logged_until, own_latest)
        if loaded.data and loaded.data.text and (run_dir / "tokenizer").is_dir():
            tracked.log_artifact(str(run_dir / "tokenizer"), "tokenizer")
        recorder = Recorder(tracked, observer, run_dir, tensorboard=w.monitor.tensorboard)
        result = RunResult("FAILED", run_name, str(run_dir), tracked.run_id, experiment, uri)
        queue = report_queue()
        best = w.checkpoint.keep_best
        keeper = best and BestKeeper(storage, run_name, best.metric, best.mode, tracked.set_tags)
        drainer = Drainer(queue, recorder, keeper or None)
        # where a stop reaches this driver, so may a stop that Ray cuts short
        watch = DriverWatch.start(uri, tracked.run_id) if signals_reach_here() else None
        try:
            trainer = _trainer(
                loaded,
                run_name,
                storage,
                _worker_config(loaded, run_dir, options, manifest, own_latest),
                queue,
                session.started_here,
            )
            drainer.start()
            fit_interruptibly(trainer)
            drainer.forget_controller()
            result.status = "FAILED" if recorder.state.fatal else "FINISHED"
            result.reason = recorder.state.fatal
            if result.ok and w.tracking.log_model:
                drainer.finish()  # every checkpoint of the run is known before the last is read
                _log_final_model(result, loaded, storage, run_name, options)
        except TrainingFailedError as exc:
            result.reason = storage_hint(failure_reason(exc), storage)
        except KeyboardInterrupt as exc:
            result.status = "KILLED"
            result.reason = exc.reason if isinstance(exc, Interrupted) else "interrupted (Ctrl-C)"
            drainer.stop_training()
        finally:
            _close_run(result, recorder, drainer, watch)
    return result


def _without_gap(storage: Storage, run_name: str, logged_until: int, newest: str) -> str:
    chosen = storage.newest_logged_through(run_name, logged_until) or newest
    if chosen != newest:
        log.warning(
            "resuming from %s: MLflow has steps up to %d, and a newer checkpoint would leave "
            "the steps between them unlogged; they are trained and logged again",
            chosen,
            logged_until,
        )
    return chosen


def _close_run(result: RunResult, recorder: Recorder, drainer: Drainer, watch: DriverWatch | None) -> None:
    """The last reports recorded and the MLflow run closed; the watch learns whether that
    happened (if not, it decides now from the stops it saw, not when this process ends)."""
    recorded = False
    try:
        if drainer.is_alive():
            drainer.finish()
        _fill_result(result, recorder)
        result.unsent_writes = recorder.finish(result.status)
        recorded = True
    finally:
        if watch:
            watch.close(recorded)


def _log_final_model(
    result: RunResult, loaded: LoadedWorkload, storage: Storage, run_name: str, options: RunOptions
) -> None:
    """The newest checkpoint as an MLflow model; a failure to log it is reported, not fatal.
    A sweep's trials log theirs unregistered: the sweep registers its best trial's."""
    # deferred: consolidation reads the model with torch; only runs that end log one
    from shoal.tracking.model_log import TOKENIZER_DIR, log_final_model

    try:
        register = None if SWEEP_TAG in options.tags else loaded.workload.tracking.register_
        logged = log_final_model(
            result.tracking_uri,
            result.run_id,
            loaded,
            storage.filesystem,
            storage.run_path(run_name),
            register,
            tokenizer_dir=Path(result.run_dir) / TOKENIZER_DIR,  # the run keeps its tokenizer there
        )
        result.model_uri = logged.uri
    except Exception as exc:  # the training succeeded and is recorded; only its model is missing
        result.model_error = str(exc) if isinstance(exc, ShoalError) else f"{type(exc).__name__}: {exc}"
        log.warning("the final model was not logged: %s", result.model_error, exc_info=True)


def _fill_result(result: RunResult, recorder: Recorder) -> None:
    state = recorder.state
    result.step, result.total_steps, result.restarts = state.step, state.total_steps, state.restarts
    result.metrics = {**{k: v for k, v in state.latest.items() if k in RESULT_METRICS}, **state.evals}
    result.checkpoint = state.checkpoints[-1] if state.checkpoints else None
    events = state.events[recorder.earlier_events :]
    starts = [e for e in events if e.kind == EventKind.ATTEMPT_STARTED]
    result.resumed_from = starts[0].get("restored_step") if starts else None
