"""A registered shoal model served by `mlflow models serve` on loopback answers /invocations
with the model's logits, for any batch size and sequence length."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import torch
from mlflow.tracking import MlflowClient

from shoal.models.gpt import GPT
from shoal.spec.schema import RegisterSpec
from shoal.tracking.model_log import log_model, token_example

PING_TIMEOUT_S = 180


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def _wait_for_ping(url: str, server: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + PING_TIMEOUT_S
    while time.monotonic() < deadline:
        assert server.poll() is None, f"the server exited: {log.read_text()[-3000:]}"
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1)
    raise AssertionError(f"no /ping answer in {PING_TIMEOUT_S} s: {log.read_text()[-3000:]}")


def test_registered_model_is_served_on_loopback(workdir: Path) -> None:
    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    experiment = client.create_experiment("serve", artifact_location=str(workdir / "artifacts"))
    run_id = client.create_run(experiment).info.run_id
    torch.manual_seed(0)
    model = GPT(vocab_size=64, seq_len=16, d_model=16, n_layers=1, n_heads=2).eval()
    logged = log_model(
        uri, run_id, model, token_example(model), True, register=RegisterSpec(name="served", alias="prod")
    )
    assert logged.uri == "models:/served@prod"

    port = _free_port()
    env = {
        **os.environ,
        "MLFLOW_TRACKING_URI": uri,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    command = [
        str(Path(sys.executable).parent / "mlflow"), "models", "serve", "-m", logged.uri,
        "--env-manager", "local", "-h", "127.0.0.1", "-p", str(port),
    ]  # fmt: skip
    log = workdir / "serve.log"
    with log.open("w") as out:
        server = subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        _wait_for_ping(f"http://127.0.0.1:{port}/ping", server, log)
        for shape in ((1, 5), (3, 9)):
            tokens = torch.randint(0, 64, shape)
            answer = _post(f"http://127.0.0.1:{port}/invocations", {"inputs": tokens.tolist()})
            with torch.no_grad():
                expected = model(tokens).numpy()
            assert np.allclose(np.asarray(answer["predictions"], dtype=np.float32), expected, atol=1e-5), (
                shape
            )
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the server we started and its workers, nothing else
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=10)
