"""A bucket that does not answer (sage_jax.run.retry, issue 50 item 3): a remote call is retried for a bounded time,
then one error names the path, the cause and the resume, and every later remote call fails at once."""

from __future__ import annotations

import logging
import time

import pytest

from sage_jax.run import paths, retry


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(retry, "_state", {"answered": True, "down": ""})
    monkeypatch.setattr(retry, "RETRY_S", 1.0)


def test_a_blip_is_ridden_out(caplog):
    calls = []

    def flaky():
        calls.append(time.monotonic())
        if len(calls) < 3:
            raise ConnectionRefusedError(111, "Connection refused")
        return "ok"
    retry.RETRY_S = 30.0
    with caplog.at_level(logging.WARNING):
        assert retry.call("gs://b/run/metrics.jsonl", flaky) == "ok"
    assert len(calls) == 3
    assert sum("does not answer" in r.getMessage() for r in caplog.records) == 1  # said once, not per try


def test_an_outage_ends_with_one_error_then_every_remote_call_fails_at_once():
    def refused():
        raise ConnectionRefusedError(111, "Connection refused")
    t0 = time.monotonic()
    with pytest.raises(retry.StorageUnreachable) as e:
        retry.call("gs://b/run/metrics.jsonl", refused)
    assert 1.0 <= time.monotonic() - t0 < 10
    message = str(e.value)
    assert "gs://b/run/metrics.jsonl did not answer for 1 s" in message and "ConnectionRefusedError" in message
    assert "last checkpoint written is intact" in message and "rerun the same command" in message
    t0 = time.monotonic()
    for call in (lambda: paths.exists("gs://b/run/log.txt"), lambda: paths.write_text("gs://b/run/x", "x"),
                 lambda: paths.fence("gs://b/run/checkpoints")):
        with pytest.raises(retry.StorageUnreachable):
            call()
    assert time.monotonic() - t0 < 1  # no waiting the outage out again on the way out
    assert retry.call("/local/path", lambda: "local") == "local"  # local files are not the bucket's business


def test_errors_about_the_file_are_not_retried():
    tries = []

    def missing():
        tries.append(1)
        raise FileNotFoundError("gs://b/run/summary.json")
    with pytest.raises(FileNotFoundError):
        retry.call("gs://b/run/summary.json", missing)
    assert tries == [1]


def test_a_store_that_never_answered_names_the_emulator_variable(monkeypatch):
    monkeypatch.setattr(retry, "_state", {"answered": False, "down": ""})
    monkeypatch.setattr(retry, "FIRST_RETRY_S", 0.2)
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)

    def dns():
        raise ConnectionError("Cannot connect to host storage.googleapis.com:443 [Name or service not known]")
    with pytest.raises(retry.StorageUnreachable, match="cannot reach the storage of gs://b/run .*STORAGE_EMULATOR_HOST"
                       " is not set"):
        retry.call("gs://b/run", dns)


def test_tensorstore_retries_are_bounded_too(monkeypatch):
    from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils
    monkeypatch.setattr(ts_utils, "_BASE_TS_CONTEXT", {"file_io_concurrency": {"limit": 128}})
    monkeypatch.setattr(ts_utils, "_DEFAULT_OCDBT_TS_CONTEXT", {})
    monkeypatch.setattr(retry, "RETRY_S", 120.0)
    retry.bound_tensorstore_retries()
    bound = ts_utils._BASE_TS_CONTEXT["gcs_request_retries"]
    assert bound == ts_utils._DEFAULT_OCDBT_TS_CONTEXT["gcs_request_retries"]
    assert bound["max_retries"] == 8  # 1 + 2 + 4 + ... + 32 + 32 s >= 120 s (tensorstore's default: 32 tries)
