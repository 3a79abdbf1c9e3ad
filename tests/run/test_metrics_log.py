import io
import json
import logging
import struct

import jax.numpy as jnp
import numpy as np
import pytest

from sage_jax.run import metrics_log as slog


def _read_events(path):
    """Records of a TensorBoard event file (TFRecord framing: len, crc(len), data, crc(data))."""
    from tensorboardX.proto import event_pb2
    events, data = [], path.read_bytes()
    i = 0
    while i < len(data):
        (n,) = struct.unpack("<Q", data[i:i + 8])
        event = event_pb2.Event()
        event.ParseFromString(data[i + 12:i + 12 + n])
        events.append(event)
        i += 12 + n + 4
    return events


def _tb_values(tb_dir):
    (event_file,) = list(tb_dir.glob("events.out.tfevents.*"))
    scalars, texts = {}, {}
    for e in _read_events(event_file):
        for v in e.summary.value:
            if v.HasField("tensor") and v.tensor.string_val:
                texts[(v.tag, e.step)] = v.tensor.string_val[0].decode()
            else:
                scalars[(v.tag, e.step)] = v.simple_value
    return scalars, texts


def test_metrics_jsonl_and_tensorboard(tmp_path):
    logger = slog.MetricsLogger(tmp_path, config_dict={"lr": 1e-3, "arm": "sage"})
    logger.log(1, {"rl/reward": jnp.float32(0.5), "loss/total": 1.25})
    logger.log(2, {"rl/reward": np.float64(0.75), "loss/total": float("nan")})
    logger.log_samples(2, [{"prompt": "2+2=", "completion": "```4```", "reward": 1.0}])
    logger.close()

    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all("time" in r for r in rows)
    assert rows[0]["rl/reward"] == 0.5 and rows[0]["loss/total"] == 1.25
    assert rows[1]["loss/total"] is None  # non-finite -> null keeps the file valid JSON
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert samples == [{"step": 2, "prompt": "2+2=", "completion": "```4```", "reward": 1.0}]
    assert json.loads((tmp_path / "config.json").read_text()) == {"arm": "sage", "lr": 1e-3}

    scalars, texts = _tb_values(tmp_path / "tb")
    assert scalars[("rl/reward", 1)] == pytest.approx(0.5) and scalars[("rl/reward", 2)] == pytest.approx(0.75)
    assert scalars[("loss/total", 1)] == pytest.approx(1.25)
    assert "2+2=" in texts[("samples/text_summary", 2)] and "arm" in texts[("config/text_summary", 0)]


def test_non_primary_writes_nothing(tmp_path):
    logger = slog.MetricsLogger(tmp_path / "run", is_primary=False)
    logger.log(1, {"x": 1.0})
    logger.log_samples(1, [{"prompt": "p", "completion": "c", "reward": 0.0}])
    logger.close()
    assert not (tmp_path / "run").exists()


def test_non_scalar_metric_is_a_clear_error(tmp_path):
    logger = slog.MetricsLogger(tmp_path, use_tensorboard=False)
    with pytest.raises(ValueError, match="rl/reward.*scalars"):
        logger.log(1, {"rl/reward": np.ones(3)})
    logger.close()


def test_late_metrics_returns_previous_step():
    late = slog.LateMetrics()
    assert late.push(1, {"loss/total": jnp.float32(1.0)}) is None
    step, host = late.push(2, {"loss/total": jnp.float32(2.0)})
    assert step == 1 and host == {"loss/total": 1.0} and type(host["loss/total"]) is float
    assert late.push(3, {"loss/total": jnp.float32(3.0)}) == (2, {"loss/total": 2.0})
    assert late.flush() == (3, {"loss/total": 3.0})
    assert late.flush() is None


def test_check_finite():
    slog.check_finite(5, {"loss/total": 1.0, "rl/kl": float("nan")}, 4)  # only loss keys are guarded
    with pytest.raises(slog.NonFiniteLossError) as err:
        slog.check_finite(17, {"loss/total": 0.5, "loss/pg": float("inf")}, 10, workdir="/runs/a")
    msg = str(err.value)
    assert "NaN/Inf at step 17" in msg and "last good checkpoint: step 10 in /runs/a/checkpoints" in msg
    assert "loss/pg" in msg and "lower learning rate" in msg and isinstance(err.value, RuntimeError)
    with pytest.raises(slog.NonFiniteLossError, match="step 3.*no good checkpoint"):
        slog.check_finite(3, {"loss/total": float("nan")}, None)
    # a finite loss with non-finite gradients, or an update the step dropped, stops the run too
    with pytest.raises(slog.NonFiniteLossError, match="opt/grad_norm"):
        slog.check_finite(4, {"loss/total": 1.0, "opt/grad_norm": float("inf")}, 2)
    with pytest.raises(slog.NonFiniteLossError, match="opt/nonfinite_update"):
        slog.check_finite(4, {"loss/total": 1.0, "opt/nonfinite_update": 1.0}, 2)
    slog.check_finite(4, {"loss/total": 1.0, "opt/grad_norm": 3.0, "opt/nonfinite_update": 0.0}, 2)


def test_resumed_run_replaces_the_killed_runs_rows(tmp_path):
    first = slog.MetricsLogger(tmp_path, use_tensorboard=False, is_primary=True)
    for step in range(4):
        first.log(step, {"rl/reward": float(step)})
    first.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "rl/rew')  # a line cut off by the kill
    resumed = slog.MetricsLogger(tmp_path, use_tensorboard=False, is_primary=True, resume_step=2)
    for step in range(2, 5):
        resumed.log(step, {"rl/reward": 10.0 + step})
    resumed.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4] and [r["rl/reward"] for r in rows] == [0, 1, 12, 13, 14]


def test_basic_config_handler_is_replaced(tmp_path, capsys):
    import logging
    root = logging.getLogger()
    saved = list(root.handlers)
    try:
        basic = logging.StreamHandler()
        basic.setFormatter(logging.Formatter(logging.BASIC_FORMAT))
        root.addHandler(basic)  # what absl's logging.basicConfig() leaves when a library logs before setup
        slog.setup_python_logging(tmp_path, "INFO", is_primary=True)
        logging.getLogger("sage_jax").warning("once only")
        err = capsys.readouterr().err
        assert err.count("once only") == 1 and basic not in root.handlers
    finally:
        for h in [h for h in root.handlers if h not in saved]:
            root.removeHandler(h)
            h.close()


def test_progress_postfix():
    out = io.StringIO()
    bar = slog.Progress(total=10, initial=2, enabled=True, file=out)
    bar.update(4, {"rl/reward": 0.5, "rl/kl": 0.0012, "rl/entropy": jnp.float32(0.8), "sage/q_mean": 1.01,
                   "sage/q_max": 1.4, "other": 3.0})
    for label in ("reward=0.5", "kl=0.0012", "entropy=0.8", "q_mean=1.01", "q_max=1.4", "step_s="):
        assert label in bar.postfix
    bar.update(5, {"rl/reward": 0.75})  # a partial update keeps the other fields
    assert "reward=0.75" in bar.postfix and "kl=0.0012" in bar.postfix
    bar.close()
    text = out.getvalue()
    assert "5/10" in text and "reward=0.75" in text
    quiet = slog.Progress(total=10, enabled=False, file=(silent := io.StringIO()))
    quiet.update(1, {"rl/reward": 1.0})
    quiet.close()
    assert silent.getvalue() == ""


def test_progress_says_the_first_step_compiles_and_leaves_it_out_of_the_eta():
    out = io.StringIO()
    bar = slog.Progress(total=100, enabled=True, file=out)
    bar._bar.refresh()
    assert "compiling" in out.getvalue()  # shown before the first step ends
    bar._bar.start_t -= 3600.0  # the first step took an hour (its compiles)
    bar.update(1, {"rl/reward": 0.5})
    assert bar._bar.initial == bar._bar.n == 1 and bar._bar.format_dict["elapsed"] < 60  # the rate starts afresh
    bar.update(2)
    assert bar._bar.n == 2 and "compiling" not in bar._bar.postfix
    bar.close()


@pytest.fixture
def root_logging():
    """The root logger as a test found it, restored after it (handlers sage_jax added are closed)."""
    root = logging.getLogger()
    before = list(root.handlers), root.level
    yield root
    for h in [h for h in root.handlers if getattr(h, "_sage_jax", False)]:
        root.removeHandler(h)
        h.close()
    root.handlers[:] = before[0]
    root.setLevel(before[1])


def test_setup_python_logging(tmp_path, root_logging):
    root = root_logging
    slog.setup_python_logging(tmp_path, "INFO", is_primary=True)
    slog.setup_python_logging(tmp_path, "INFO", is_primary=True)  # idempotent: no duplicate lines
    logging.getLogger("sage_jax.test").info("hello %d", 7)
    for h in root.handlers:
        h.flush()
    lines = (tmp_path / "log.txt").read_text().splitlines()
    assert len(lines) == 1 and lines[0].endswith("I sage_jax.test] hello 7")
    with pytest.raises(ValueError, match="log level"):
        slog.setup_python_logging(tmp_path, "LOUD")


def test_step_summary_is_logged_without_the_bar(tmp_path, capsys, root_logging):
    """train.progress=False: each step's one-line summary still reaches the console and log.txt; with the bar on,
    log.txt still gets it and the console only the bar."""
    root = root_logging
    slog.setup_python_logging(tmp_path, "INFO", is_primary=True)
    quiet = slog.Progress(total=10, enabled=False)
    quiet.update(1, {"rl/reward": 0.25})
    quiet.update(2, {"rl/reward": 0.5, "rl/kl": 0.01})
    quiet.close()
    bar = slog.Progress(total=10, enabled=True, file=(out := io.StringIO()), desc="rl")
    bar.update(3, {"rl/reward": 0.75})
    bar.close()
    for h in root.handlers:
        h.flush()
    lines = (tmp_path / "log.txt").read_text().splitlines()
    assert [line.split("] ", 1)[1].split(", step_s")[0] for line in lines] == [
        "train step 1/10: reward=0.25", "train step 2/10: reward=0.5, kl=0.01", "rl step 3/10: reward=0.75"]
    err = capsys.readouterr().err
    assert "train step 1/10: reward=0.25" in err and "train step 2/10" in err and "rl step 3/10" not in err
    assert "reward=0.75" in out.getvalue()


def test_each_step_line_is_in_a_bucket_log_when_the_step_is_done(monkeypatch):
    """Issue 50 ("Also"): after a kill -9 on gs://, log.txt lacked the last step's line that stderr had; lines were
    held up to FLUSH_S seconds. A step's line is appended at once, as its metrics row is."""
    import logging
    appended = []
    monkeypatch.setattr(slog.paths, "append_text", lambda path, text: appended.append((path, text)))
    handler = slog._BucketLog("gs://bucket/run/log.txt")
    handler.setLevel(logging.INFO)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        for enabled in (True, False):  # with a bar, and without (train.progress=False: the line is the console's too)
            appended.clear()
            progress = slog.Progress(total=3, enabled=enabled, file=io.StringIO())
            progress.update(1, {"rl/reward": 0.5})
            assert [p for p, t in appended if "train step 1/3" in t] == ["gs://bucket/run/log.txt"], appended
            progress.close()
    finally:
        root.removeHandler(handler)
