"""trapo.training.loggers: TensorBoard, wandb (offline) and MLflow (file store) fed by one object, read back
from disk."""

import math
import sys

import pytest

from trapo.config import ConfigError, load_config
from trapo.training.loggers import Loggers, check_packages, mlflow_key, read_wandb_history
from trapo.training.tensorboard_writer import read_scalars

# Two metrics.jsonl rows as the trainer writes them: nested dicts, a flag, values that are not scalars.
STEPS = [
    {
        "step": 1,
        "epoch": 1,
        "loss": 0.5,
        "skipped": False,
        "timing": {"rollout": 1.25, "update": 2.0},
        "eval": None,
        "note": "text",
        "grading_timeouts": 0,
    },
    {
        "step": 2,
        "epoch": 1,
        "loss": math.nan,
        "skipped": True,
        "timing": {"rollout": 1.5, "update": 2.5},
        "eval": {"mean": 0.25, "aime+24": 0.125},
        "grading_timeouts": 3,
    },
]
# What every backend must hold: "step" is the x axis; NaN, None and strings are left out; True -> 1.0.
EXPECTED = {
    "epoch": [(1, 1.0), (2, 1.0)],
    "loss": [(1, 0.5)],
    "skipped": [(1, 0.0), (2, 1.0)],
    "timing/rollout": [(1, 1.25), (2, 1.5)],
    "timing/update": [(1, 2.0), (2, 2.5)],
    "eval/mean": [(2, 0.25)],
    "eval/aime+24": [(2, 0.125)],
    "grading_timeouts": [(1, 0.0), (2, 3.0)],
}
# A selection.jsonl row closing epoch 1 at step 2: 4 unlabeled questions, 2 selected (one right, one wrong).
ROW = {
    "epoch": 1,
    "tcs": [0.9, 0.8, 0.1, 0.2],
    "pseudo_correct": [True, False, True, None],
    "selected": [True, True, False, False],
}
EPOCH = {
    "size": 2.0,
    "unlabeled": 4.0,
    "share": 0.5,
    "precision_selected": 0.5,
    "precision_rejected": 1.0,
    "tcs_selected": (0.9 + 0.8) / 2,
    "tcs_rejected": (0.1 + 0.2) / 2,
    "tcs_cut": 0.8,
}


def config(tmp_path, *extra):
    return load_config(None, ["toy.enabled=true", f"output_dir={tmp_path}", "run_name=r", *extra])


ALL = [
    "logging.tensorboard=true",
    "logging.wandb.enabled=true",
    "logging.wandb.mode=offline",
    "logging.wandb.project=proj",
    "logging.wandb.tags=[toy, a]",
    "logging.mlflow.enabled=true",
    "logging.mlflow.experiment=exp",
]


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """No account, no server: wandb's settings and MLflow's default URI from the environment cleared."""
    for name in ("WANDB_DIR", "WANDB_API_KEY", "WANDB_MODE", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc login either
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # for the test's own client (the logger sets it too)


def log_all(loggers):
    for row in STEPS:
        if row["step"] == 2:
            loggers.log_selection(ROW, step=2)  # the trainer's order: the epoch closes inside step 2
        loggers.log_step(row)
    loggers.close()


def test_every_backend_holds_every_scalar_at_its_step(tmp_path, offline):
    from mlflow.tracking import MlflowClient

    cfg = config(tmp_path, *ALL)
    loggers = Loggers.open(cfg, is_main=True)
    assert [b.name for b in loggers.backends] == ["tensorboard", "wandb", "mlflow"]
    wandb_dir = loggers.backends[1].dir
    log_all(loggers)
    selection = {f"selection_epoch/{k}": [(2, v)] for k, v in EPOCH.items()}

    # wandb: the offline run's .wandb file under run_dir/wandb/, read record by record
    assert wandb_dir.parent == tmp_path / "r" / "wandb" and wandb_dir.name.startswith("offline-run-")
    history = read_wandb_history(wandb_dir)
    assert history == {**EXPECTED, **selection}  # JSON doubles: exact

    # MLflow: the file store in run_dir/mlruns, read back through the client
    client = MlflowClient(tracking_uri=(tmp_path / "r" / "mlruns").as_uri())
    experiment = client.get_experiment_by_name("exp")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "r" and run.info.status == "FINISHED"
    assert run.data.params["rollout.n"] == "8" and run.data.params["logging.wandb.mode"] == "offline"
    for key, points in {**EXPECTED, **selection}.items():
        got = client.get_metric_history(run.info.run_id, mlflow_key(key))
        assert [(m.step, m.value) for m in got] == points, key
    assert mlflow_key("eval/aime+24") == "eval/aime_24"  # '+' is not a character MLflow takes

    # TensorBoard as before: steps at their step, the selection row at x = epoch
    scalars = read_scalars(tmp_path / "r" / "tensorboard")
    steps = {k: v for k, v in scalars.items() if not k.startswith("selection_epoch/")}
    assert steps.keys() == {mlflow_key(k) for k in EXPECTED}  # tensorboardX also makes '+' a '_'
    for key, points in EXPECTED.items():  # float32 in event files
        assert [s for s, _ in steps[mlflow_key(key)]] == [s for s, _ in points]
        assert [v for _, v in steps[mlflow_key(key)]] == pytest.approx([v for _, v in points]), key
    assert scalars["selection_epoch/size"] == [(1, 2.0)]


def test_other_ranks_open_nothing(tmp_path, offline):
    loggers = Loggers.open(config(tmp_path, *ALL), is_main=False)
    assert not loggers and loggers.backends == []
    log_all(loggers)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(("module", "key"), [("wandb", "logging.wandb.enabled"), ("mlflow", "logging.mlflow.enabled")])
def test_missing_package_names_its_key_on_every_rank(tmp_path, monkeypatch, module, key):
    monkeypatch.setitem(sys.modules, module, None)  # the import now fails as if it were not installed
    cfg = config(tmp_path, f"{key}=true")
    for is_main in (True, False):
        with pytest.raises(ConfigError, match=rf"^{key}: true needs the {module} package.*pip install"):
            Loggers.open(cfg, is_main)
    check_packages(config(tmp_path))  # nothing enabled: nothing needed


def test_wandb_online_without_a_login_is_one_error_naming_the_key(tmp_path, offline):
    cfg = config(tmp_path, "logging.wandb.enabled=true", "logging.mlflow.enabled=true", "logging.tensorboard=true")
    with pytest.raises(ConfigError, match=r"^logging.wandb: wandb.init failed \(no login.*mode=offline\).*API key"):
        Loggers.open(cfg, is_main=True)


def test_mlflow_sql_store_without_sqlalchemy_names_the_uri_key(tmp_path, offline, monkeypatch):
    monkeypatch.setitem(sys.modules, "sqlalchemy", None)  # mlflow-skinny, as pinned, has no SQL store
    cfg = config(tmp_path, "logging.mlflow.enabled=true", f"logging.mlflow.tracking_uri=sqlite:///{tmp_path}/m.db")
    with pytest.raises(ConfigError, match=r"^logging.mlflow.tracking_uri: sqlite:///.*SQLAlchemy.*file: URI"):
        Loggers.open(cfg, is_main=True)


def test_mlflow_explicit_file_uri_and_a_store_lost_mid_run_warns_once(tmp_path, offline, capsys):
    import shutil

    from mlflow.tracking import MlflowClient

    store = tmp_path / "elsewhere"
    cfg = config(tmp_path, "logging.mlflow.enabled=true", f"logging.mlflow.tracking_uri={store.as_uri()}")
    loggers = Loggers.open(cfg, is_main=True)
    loggers.log_step(STEPS[0])
    client = MlflowClient(tracking_uri=store.as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("trapo").experiment_id])
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")] == [(1, 0.5)]
    shutil.rmtree(store)  # the store goes away: logging fails, training must not
    loggers.log_step(STEPS[1])
    loggers.log_step(STEPS[1])
    captured = capsys.readouterr()
    err = captured.out + captured.err
    assert err.count("warning: logging to mlflow failed") == 1 and "training goes on" in err


def test_logging_config_keys_and_checks(tmp_path):
    cfg = config(tmp_path)
    assert (cfg.logging.wandb.enabled, cfg.logging.mlflow.enabled, cfg.logging.rollouts_every) == (False, False, 0)
    assert cfg.logging.wandb.mode == "online" and cfg.logging.mlflow.tracking_uri is None
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("logging:\n  wandb: {enabled: true, mode: offline, tags: [x]}\n  rollouts_every: 5\n")
    loaded = load_config(str(yaml_file), ["toy.enabled=true"])
    assert loaded.logging.wandb.tags == ["x"] and loaded.logging.rollouts_every == 5
    bad = {
        "logging.rollouts_every=-1": "logging.rollouts_every': must be >= 0",
        "logging.wandb.mode=sync": "logging.wandb.mode'.*one of 'online', 'offline'",
        "logging.wandb.projekt=x": "projekt' is not a known setting; did you mean 'logging.wandb.project'",
    }
    for override, message in bad.items():
        with pytest.raises(ConfigError, match=message):
            config(tmp_path, override)
    with pytest.raises(ConfigError, match="logging.wandb.tags'.*1-64 characters"):
        config(tmp_path, "logging.wandb.enabled=true", f"logging.wandb.tags=[{'t' * 65}]")
    with pytest.raises(ConfigError, match="logging.mlflow.experiment'"):
        config(tmp_path, "logging.mlflow.enabled=true", "logging.mlflow.experiment=' '")
    with pytest.raises(ConfigError, match="logging.mlflow.tracking_uri'"):
        config(tmp_path, "logging.mlflow.enabled=true", "logging.mlflow.tracking_uri=''")


def _open_on_rank(rank: int, port: int, run_dir: str, queue) -> None:
    """One of two gloo ranks: rank 0's wandb cannot start (online, no login); report what each rank raised."""
    import os

    import torch.distributed as torch_dist

    os.environ.update(HOME=run_dir, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR"):
        os.environ.pop(name, None)
    torch_dist.init_process_group("gloo", rank=rank, world_size=2)
    cfg = load_config(None, ["toy.enabled=true", f"output_dir={run_dir}", "run_name=r", "logging.wandb.enabled=true"])
    try:
        Loggers.open_everywhere(cfg, is_main=rank == 0)
        queue.put((rank, None))
    except ConfigError as err:
        queue.put((rank, str(err)))
    finally:
        torch_dist.destroy_process_group()


def test_a_backend_failing_on_rank_0_stops_every_rank_with_its_message(tmp_path):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_open_on_rank, args=(r, port, str(tmp_path), queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert results[0] is not None and results[0].startswith("logging.wandb: wandb.init failed")
    assert results[1] == results[0]  # rank 1 did not wait for rank 0: it got the same one-line cause
