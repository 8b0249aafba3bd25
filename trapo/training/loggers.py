"""Experiment loggers: TensorBoard, Weights & Biases and MLflow behind one object (config `logging.*`).

    loggers = Loggers.open(cfg, is_main)   # every rank: packages checked; rank 0 opens the backends
    loggers.log_step(step_log)             # the dict written to metrics.jsonl, once per step
    loggers.log_selection(row, step)       # a selection.jsonl row, at the step that closed the epoch
    loggers.close()

Every backend gets the same scalars: each numeric value of the step dict,
nested dicts flattened with "/" (`tensorboard_writer.flatten_scalars`), at
x = the step number of metrics.jsonl (1-based), and the per-epoch selection
diagnostics of `tensorboard_writer.selection_scalars` under `selection_epoch/`
(TensorBoard keeps them at x = epoch, its histograms beside them; wandb and
MLflow need one x axis per run, so there they sit at the step that closed the
epoch).

The packages are optional: each is imported only when its key is on. A
missing package, a wandb that cannot start (online without a login, say) or
an MLflow store that cannot be opened is one `ConfigError` naming the key,
raised when the run starts, before the first step. Once running, a backend
that fails to log (a tracking server gone away) is warned about once and the
run goes on: a lost curve is not worth a lost training run.

`read_wandb_history` reads an offline run's `.wandb` file back without the
network, for tests and scripts.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import struct
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from urllib.parse import urlparse

from trapo import console
from trapo.config import Config, ConfigError, MlflowConfig, WandbConfig, to_dict
from trapo.training.tensorboard_writer import flatten_scalars, selection_scalars

# The pins in requirements.txt, named in the install hint of a missing package.
PINS = {"wandb": "wandb==0.31.0", "mlflow": "mlflow-skinny==3.17.2", "tensorboardX": "tensorboardX==2.6.5"}
SQL_SCHEMES = ("sqlite", "mysql", "postgresql", "mssql")  # mlflow's SQLAlchemy stores


def step_scalars(step_log: Mapping) -> dict[str, float]:
    """{tag: value} of one metrics.jsonl row, without its x axis ("step")."""
    return flatten_scalars({k: v for k, v in step_log.items() if k != "step"})


def epoch_scalars(row: Mapping) -> dict[str, float]:
    """{"selection_epoch/<name>": value} of one selection.jsonl row."""
    return {f"selection_epoch/{k}": v for k, v in selection_scalars(row).items()}


def _installed(module: str) -> bool:
    """Importable, without importing it (a None in sys.modules marks a module as blocked)."""
    if module in sys.modules:
        return sys.modules[module] is not None
    return importlib.util.find_spec(module) is not None


def check_packages(cfg: Config) -> None:
    """Every enabled backend's package importable, else a ConfigError naming its key (not collective, cheap:
    nothing is imported). Called on every rank, so all ranks stop alike rather than rank 0 alone."""
    wanted = [
        ("tensorboardX", "logging.tensorboard", cfg.logging.tensorboard),
        ("wandb", "logging.wandb.enabled", cfg.logging.wandb.enabled),
        ("mlflow", "logging.mlflow.enabled", cfg.logging.mlflow.enabled),
    ]
    for module, key, on in wanted:
        if on and not _installed(module):
            raise ConfigError(
                f"{key}: true needs the {module} package, which is not installed; "
                f"install it with `pip install {PINS[module]}` or set {key}=false"
            )


# ---------------------------------------------------------------------------- backends


class _TensorBoard:
    """trapo.training.tensorboard_writer behind the common interface (selection rows at x = epoch, as before)."""

    name = "tensorboard"

    def __init__(self, run_dir: Path):
        from trapo.training.tensorboard_writer import TensorBoardWriter

        self.writer = TensorBoardWriter(run_dir / "tensorboard")

    def log_step(self, step_log: Mapping) -> None:
        self.writer.log_step(step_log)

    def log_selection(self, row: Mapping, step: int) -> None:
        self.writer.log_selection(row)

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """One wandb run; files under run_dir/wandb/ (or $WANDB_DIR), config.yaml as the run's config."""

    name = "wandb"

    def __init__(self, settings: WandbConfig, run_name: str, run_dir: Path, config: dict, run_id: str | None = None):
        """run_id: the id of the run to continue (a resumed training run); None starts a new one."""
        import wandb

        run_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.run = wandb.init(
                id=run_id,
                resume="allow" if run_id else None,  # online: the same run, its history continued
                project=settings.project,
                name=settings.run_name or run_name,
                mode=settings.mode,
                tags=settings.tags or None,
                config=config,
                dir=None if os.environ.get("WANDB_DIR") else str(run_dir),
                # console="off": the trainer's own console and log files stay as they are
                settings=wandb.Settings(console="off", silent=True),
            )
        except Exception as err:  # wandb raises its own UsageError, CommError, ValueError...
            hint = " (no login? `wandb login`, or logging.wandb.mode=offline)" if settings.mode == "online" else ""
            raise ConfigError(
                f"logging.wandb: wandb.init failed{hint}: {type(err).__name__}: {err}; "
                "or set logging.wandb.enabled=false"
            ) from err

        # A resumed run's server-side history already holds the steps up to its last log; a step redone after
        # the checkpoint (the same values: resume is exact) is not sent again (offline: nothing is known, 0).
        self.next_step = int(self.run.step or 0)

    @property
    def id(self) -> str:
        return self.run.id

    @property
    def dir(self) -> Path:
        """This run's folder (offline-run-... or run-...), holding its .wandb file."""
        return Path(self.run.dir).parent

    def log_step(self, step_log: Mapping) -> None:
        if int(step_log["step"]) >= self.next_step:
            self.run.log(step_scalars(step_log), step=int(step_log["step"]))

    def log_selection(self, row: Mapping, step: int) -> None:
        # Same x as the step's own row (logged after it): wandb merges both into one history row.
        if step >= self.next_step:
            self.run.log(epoch_scalars(row), step=int(step))

    def close(self) -> None:
        self.run.finish()


def mlflow_key(tag: str) -> str:
    """A metric or param name MLflow accepts: its characters are alphanumerics, _ - . space / (and :
    outside Windows); anything else (a benchmark file's '+', say) becomes '_'."""
    return re.sub(r"[^/\w.\- ]", "_", tag)


def _flat_params(values: Mapping, prefix: str = "") -> dict[str, str]:
    out = {}
    for key, value in values.items():
        if isinstance(value, Mapping):
            out.update(_flat_params(value, f"{prefix}{key}."))
        else:
            out[mlflow_key(f"{prefix}{key}")] = str(value)[:6000]  # MLflow's longest param value
    return out


class MlflowLogger:
    """One MLflow run in `experiment` (created when missing) under the tracking URI; the config as params."""

    name = "mlflow"

    def __init__(self, settings: MlflowConfig, run_name: str, run_dir: Path, config: dict, run_id: str | None = None):
        """run_id: the run to continue (a resumed training run), reopened as RUNNING; None creates one."""
        self.uri = (
            settings.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or (run_dir / "mlruns").resolve().as_uri()
        )
        scheme = urlparse(self.uri).scheme.split("+")[0]
        if scheme in SQL_SCHEMES and not _installed("sqlalchemy"):
            raise ConfigError(
                f"logging.mlflow.tracking_uri: {self.uri} needs MLflow's SQL store (SQLAlchemy), which "
                f"mlflow-skinny leaves out; use a file: URI (null: {run_dir / 'mlruns'}) or install the full mlflow"
            )
        if scheme in ("", "file"):
            # MLflow 3.x refuses its file store unless this is set (it is in "maintenance mode"); it still
            # works, and needs nothing beyond mlflow-skinny.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            if scheme == "":
                Path(self.uri).mkdir(parents=True, exist_ok=True)
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self._metric = Metric
        try:
            self.client = MlflowClient(tracking_uri=self.uri)
            experiment = self.client.get_experiment_by_name(settings.experiment)
            experiment_id = (
                experiment.experiment_id if experiment else self.client.create_experiment(settings.experiment)
            )
            self.next_step = 0
            if run_id:  # its history up to the last step logged is there: later steps only (no repeats)
                self.run_id = run_id
                self.client.update_run(run_id, status="RUNNING")
                logged = self.client.get_metric_history(run_id, "loss")
                self.next_step = max((m.step for m in logged), default=-1) + 1
            else:
                self.run_id = self.client.create_run(experiment_id, run_name=settings.run_name or run_name).info.run_id
                self.client.log_batch(self.run_id, params=[Param(k, v) for k, v in _flat_params(config).items()])
        except Exception as err:  # MlflowException, a refused connection, a permission error...
            raise ConfigError(
                f"logging.mlflow: cannot open a run in experiment '{settings.experiment}' at {self.uri} "
                f"({type(err).__name__}: {err}); check logging.mlflow.tracking_uri or set logging.mlflow.enabled=false"
            ) from err

    @property
    def id(self) -> str:
        return self.run_id

    def _log(self, scalars: dict[str, float], step: int) -> None:
        if step < self.next_step:
            return
        now = int(time.time() * 1000)
        metrics = [self._metric(mlflow_key(k), v, now, step) for k, v in scalars.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def log_step(self, step_log: Mapping) -> None:
        self._log(step_scalars(step_log), int(step_log["step"]))

    def log_selection(self, row: Mapping, step: int) -> None:
        self._log(epoch_scalars(row), int(step))

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


# ---------------------------------------------------------------------------- the fan-out


class Loggers:
    """The enabled backends of one run; empty on ranks other than 0 (every call a no-op there)."""

    def __init__(self, backends: list):
        self.backends = backends

    @classmethod
    def open(cls, cfg: Config, is_main: bool, run_ids: Mapping[str, str] | None = None) -> Loggers:
        """Check the packages (every rank), then on rank 0 open each enabled backend.

        run_ids: {"wandb": id, "mlflow": id} of the runs to continue (from the checkpoint a run resumed);
        the ids in use are written to run_dir/trackers.json. Raises ConfigError naming the key for a missing
        package or a backend that cannot start; the backends opened before it are closed first.
        """
        check_packages(cfg)
        if not is_main:
            return cls([])
        lg, run_dir, config, ids = cfg.logging, cfg.run_dir, to_dict(cfg), dict(run_ids or {})
        makers = [
            (lg.tensorboard, lambda: _TensorBoard(run_dir)),
            (lg.wandb.enabled, lambda: WandbLogger(lg.wandb, cfg.run_name, run_dir, config, ids.get("wandb"))),
            (lg.mlflow.enabled, lambda: MlflowLogger(lg.mlflow, cfg.run_name, run_dir, config, ids.get("mlflow"))),
        ]
        opened = cls([])
        try:
            for on, make in makers:
                if on:
                    opened.backends.append(make())
        except BaseException:
            opened.close()
            raise
        if opened.ids():
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "trackers.json").write_text(json.dumps(opened.ids(), indent=2) + "\n")
        return opened

    def ids(self) -> dict[str, str]:
        """{"wandb": run id, "mlflow": run id} of the open tracker runs (for the checkpoint)."""
        return {b.name: b.id for b in self.backends if hasattr(b, "id")}

    @classmethod
    def open_everywhere(cls, cfg: Config, is_main: bool, run_ids: Mapping[str, str] | None = None) -> Loggers:
        """`open` on every rank, then every rank learns whether rank 0's backends started (collective):
        a wandb that fails on rank 0 stops all ranks with its message, not rank 0 alone while the others
        wait for it until the distributed timeout."""
        from trapo.engine import dist

        loggers, message = cls([]), None
        try:
            loggers = cls.open(cfg, is_main, run_ids)
        except ConfigError as err:
            message = str(err)
        failures = [m for m in dist.all_gather(message) if m is not None]
        if failures:
            loggers.close()
            raise ConfigError(failures[0])
        return loggers

    def _each(self, call) -> None:
        for backend in self.backends:
            try:
                call(backend)
            except Exception as err:  # noqa: BLE001 - a logger must not stop training; metrics.jsonl has it all
                console.warn_once(
                    f"logger-{backend.name}",
                    f"logging to {backend.name} failed ({type(err).__name__}: {err}); training goes on, "
                    "metrics.jsonl still has every value (warned once)",
                )

    def log_step(self, step_log: Mapping) -> None:
        self._each(lambda b: b.log_step(step_log))

    def log_selection(self, row: Mapping, step: int) -> None:
        self._each(lambda b: b.log_selection(row, step))

    def close(self) -> None:
        self._each(lambda b: b.close())
        self.backends = []

    def __bool__(self) -> bool:
        return bool(self.backends)


# ---------------------------------------------------------------------------- reading back

_WANDB_HEADER = struct.Struct("<4sHB")  # ":W&B", magic 0xBEE1, version 0
_CHUNK_HEADER = struct.Struct("<IHB")  # crc32, length, type (1 full, 2 first, 3 middle, 4 last)
_BLOCK = 32768


def read_wandb_records(path: str | Path) -> Iterator:
    """Every Record (wandb.proto.wandb_internal_pb2) of a run's .wandb file, in order.

    The file is LevelDB-log framed: a 7-byte header, then 32 KiB blocks of
    chunks, each with a 7-byte header (crc32, length, type); a record spans a
    FIRST, MIDDLE... and LAST chunk when it crosses a block, and a block's
    tail under 7 bytes is padding. CRCs are not checked; a truncated last
    chunk (a writer killed mid-write) ends the file.
    """
    from wandb.proto.wandb_internal_pb2 import Record

    data = Path(path).read_bytes()
    ident, magic, version = _WANDB_HEADER.unpack_from(data, 0)
    if ident != b":W&B" or magic != 0xBEE1:
        raise ValueError(f"{path}: not a .wandb file (header {data[:7]!r})")
    pos, parts = _WANDB_HEADER.size, []
    while pos + _CHUNK_HEADER.size <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _CHUNK_HEADER.size:
            pos += left
            continue
        _, length, kind = _CHUNK_HEADER.unpack_from(data, pos)
        if kind == 0:  # zero padding to the block's end
            pos += left
            continue
        start = pos + _CHUNK_HEADER.size
        if start + length > len(data):
            break
        parts = [data[start : start + length]] if kind in (1, 2) else [*parts, data[start : start + length]]
        pos = start + length
        if kind in (1, 4):
            record = Record()
            record.ParseFromString(b"".join(parts))
            yield record


def read_wandb_history(run_path: str | Path) -> dict[str, list[tuple[int, float]]]:
    """{key: [(step, value), ...]} of an offline wandb run (a run folder or its .wandb file); wandb's own
    `_step`, `_runtime`, `_timestamp` left out. One history row per step, keys merged as wandb does."""
    import json

    path = Path(run_path)
    if path.is_dir():
        path = next(path.glob("*.wandb"))
    out: dict[str, list[tuple[int, float]]] = {}
    for record in read_wandb_records(path):
        if record.WhichOneof("record_type") != "history":
            continue
        step = record.history.step.num
        for item in record.history.item:
            key = "/".join(item.nested_key) if item.nested_key else item.key
            if not key.startswith("_"):
                out.setdefault(key, []).append((step, json.loads(item.value_json)))
    return out
