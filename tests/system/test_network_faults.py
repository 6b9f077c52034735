"""Real network faults between network namespaces of the test's own (see netns.py): a Ray
head and two worker nodes, one of whose links goes down mid-run (the run fails over to the
other node, data exactly once) or slows to 50 ± 10 ms each way (a straggler event names the
rank behind it, and training goes on); a tracking server behind a link that loses 20 % of
its packets each way (every metric point arrives exactly once).

The namespaces, links and every process in them are made and removed by the test, also on
failure; the test is skipped, with the reason, where network namespaces are not permitted.
"""

from __future__ import annotations

import json
import secrets
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from mlflow.tracking import MlflowClient

from shoal.data import prepare
from shoal.data.sources import parquet_files
from tests.conftest import quickstart, write_workload
from tests.integration.helpers import assert_exactly_once, events, loss_steps, wait_for
from tests.system.conftest import FAST_NODE_FAILURE
from tests.system.netns import Network, Node, why_not_permitted

NOT_PERMITTED = why_not_permitted()
pytestmark = pytest.mark.skipif(NOT_PERMITTED is not None, reason=NOT_PERMITTED or "")
STEPS, MLFLOW_PORT = 30, 5000
WAIT_FOR_SERVER = """
import sys, time, urllib.request
deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    try:
        with urllib.request.urlopen(sys.argv[1] + "/health", timeout=5) as answer:
            sys.exit(0 if answer.status == 200 else 1)
    except OSError:
        time.sleep(1)
sys.exit(1)
"""


def start_mlflow(net: Network, node: Node, root: Path) -> None:
    command = [
        sys.executable, "-m", "mlflow", "server", "--host", node.address, "--port", str(MLFLOW_PORT),
        "--backend-store-uri", f"sqlite:///{root / 'server.db'}",
        "--artifacts-destination", str(root / "artifacts"), "--workers", "1",
    ]  # fmt: skip
    return net.popen(node, command, root / "server.log")


def test_metrics_cross_a_lossy_link_to_the_tracking_server_exactly_once(workdir: Path) -> None:
    with Network(workdir) as net:
        driver, store = net.add("driver"), net.add("mlflow", shaped=True)
        start_mlflow(net, store, workdir)
        uri = f"http://{store.address}:{MLFLOW_PORT}"
        assert net.run(driver, [sys.executable, "-c", WAIT_FOR_SERVER, uri], 150).returncode == 0
        net.shape(store, loss=0.2)

        data = quickstart()
        data["train"].update(max_steps=STEPS, eval_every=10)
        data["checkpoint"]["every_steps"] = 15
        write_workload(workdir, data, "w.yaml")
        run = [sys.executable, "-m", "shoal.cli", "run", "w.yaml", "--run-name", "lossy"]
        job = net.popen(driver, [*run, "--set", f"tracking.uri={uri}"], workdir / "driver.log", cwd=workdir)
        assert job.wait(timeout=900) == 0, (workdir / "driver.log").read_text()[-3000:]
        counts = net.link_counts(store)
        assert counts["dropped"] > 0.1 * counts["frames"] > 0, counts  # the link did lose packets
        print(f"tracking link: {counts['dropped']} of {counts['frames']} frames dropped")

    client = MlflowClient(f"sqlite:///{workdir / 'server.db'}")  # what the server stored
    (run_info,) = client.search_runs([client.get_experiment_by_name("quickstart").experiment_id])
    assert run_info.info.status == "FINISHED"
    assert loss_steps(client, run_info.info.run_id) == list(range(1, STEPS + 1))  # each once
    for key in ("val/loss", "val/accuracy"):
        assert sorted(m.step for m in client.get_metric_history(run_info.info.run_id, key)) == [10, 20, 30]


RAY_PORT, ELASTIC_STEPS = 6379, 300
NODES_ALIVE = """
import sys, ray
ray.init(address=sys.argv[1], log_to_driver=False)
print(len([n for n in ray.nodes() if n["Alive"]]))
"""


def start_ray(net: Network, head: Node, workers: list[Node], logs: Path) -> str:
    """`ray start` in each namespace, one node at a time: the head (1 CPU: the driver's Ray
    Data and Ray Train's controller) and a 2-CPU node per worker; the address to attach to."""
    ray = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", "--disable-usage-stats"]
    address = f"{head.address}:{RAY_PORT}"
    head_args = ["--head", f"--port={RAY_PORT}", "--num-cpus=1", "--include-dashboard=false"]
    head_args += [f"--system-config={json.dumps(FAST_NODE_FAILURE)}", f"--node-ip-address={head.address}"]
    # 2 cores: a raylet may take a while. gloo finds its address from the host name, which
    # here is on the host's own interface: the workers' collectives must use the links.
    env = net.env(RAY_raylet_start_wait_time_s="120", GLOO_SOCKET_IFNAME="eth0")
    net.popen(head, [*ray, *head_args], logs / "ray-head.log", env=env)
    _wait_for_nodes(net, head, address, 1)
    for count, node in enumerate(workers, start=2):
        args = [f"--address={address}", f"--node-ip-address={node.address}", "--num-cpus=2"]
        net.popen(node, [*ray, *args], logs / f"ray-{node.namespace}.log", env=env)
        _wait_for_nodes(net, head, address, count)
    return address


def _wait_for_nodes(net: Network, head: Node, address: str, count: int) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        alive = net.run(head, [sys.executable, "-c", NODES_ALIVE, address], 60).stdout.strip()
        if alive.splitlines()[-1:] == [str(count)]:
            return
        time.sleep(3)
    raise AssertionError(f"the cluster in the namespaces did not reach {count} nodes")


def audited_world(run_dir: Path) -> int:
    """How many ranks audited steps in the latest attempt so far."""
    ranks: dict[str, set[str]] = {}
    for path in (run_dir / "audit").glob("rank*.jsonl"):
        for line in path.read_text().splitlines():
            ranks.setdefault(json.loads(line)["attempt"], set()).add(path.stem)
    return len(ranks[max(ranks, key=float)]) if ranks else 0


def newest_checkpoint(run_dir: Path) -> int:
    try:
        snapshot = (run_dir / "checkpoint_manager_snapshot.json").read_text()
    except OSError:
        return 0
    return max((int(p.name[11:]) for p in run_dir.glob("checkpoint-*") if p.name in snapshot), default=0)


def two_node_workload(
    workdir: Path, monkeypatch: pytest.MonkeyPatch, name: str, steps: int, workers: object
) -> dict:
    """A tiny quickstart for a worker on each node, with a Ray token of this cluster's own."""
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", secrets.token_hex(32))
    data = quickstart()
    data["model"]["args"] = {"channels": 8}
    data["train"].update(max_steps=steps, eval_every=1000)
    data["checkpoint"]["every_steps"] = 20
    data["scaling"] = {"workers": workers, "cpus_per_worker": 2, "threads_per_worker": 1}
    data["failure"].update(worker_start_timeout_s=10, max_restarts=5)
    write_workload(workdir, data, name)
    return data


def test_a_worker_nodes_link_going_down_fails_over_to_the_other_node(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = two_node_workload(workdir, monkeypatch, "elastic.yaml", ELASTIC_STEPS, {"min": 1, "max": 2})
    run_dir = workdir / "shoal_runs" / "elastic"
    with Network(workdir) as net:
        head, kept, cut = net.add("head"), net.add("w1"), net.add("w2")
        address = start_ray(net, head, [kept, cut], workdir)
        args = [sys.executable, "-m", "shoal.cli", "run", "elastic.yaml", "--address", address]
        env = net.env(SHOAL_AUDIT_SAMPLES="1")
        driver = net.popen(
            head, [*args, "--run-name", "elastic"], workdir / "driver.log", cwd=workdir, env=env
        )
        running = lambda: driver.poll() is None  # noqa: E731
        wait_for(
            lambda: (audited_world(run_dir) == 2 and newest_checkpoint(run_dir) >= 40) or not running(),
            300,
            "2 workers",
        )
        assert running(), (workdir / "driver.log").read_text()[-3000:]
        cut_at = time.time()
        net.link_down(cut)
        wait_for(lambda: audited_world(run_dir) == 1 or not running(), 300, "the fail-over to one node")
        assert driver.wait(timeout=600) == 0, (workdir / "driver.log").read_text()[-3000:]

    rows = sum(
        pq.read_metadata(f).num_rows for f in parquet_files(str(prepare("digits") / "train"), "digits")
    )
    assert_exactly_once(run_dir, ELASTIC_STEPS, data["train"]["global_batch_size"], rows)
    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("quickstart").experiment_id])
    assert run.info.status == "FINISHED"
    assert loss_steps(client, run.info.run_id) == list(range(1, ELASTIC_STEPS + 1))
    history = events(client, run.info.run_id, workdir)
    assert (2, 1) in [(e["previous_world_size"], e["world_size"]) for e in history if e["kind"] == "resized"]
    records = [json.loads(line) for path in (run_dir / "audit").glob("rank*.jsonl") for line in path.open()]
    first_after = min(r["time"] for r in records if float(r["attempt"]) > cut_at)
    print(f"link down -> next step: {first_after - cut_at:.1f} s")


SLOW_LINK_STEPS = 150


def test_a_slow_link_names_the_rank_behind_it_and_training_goes_on(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = two_node_workload(workdir, monkeypatch, "slow.yaml", SLOW_LINK_STEPS, 2)
    data["monitor"] = {"stragglers": {"link_probe_every_s": 1.0}}
    write_workload(workdir, data, "slow.yaml")
    run_dir = workdir / "shoal_runs" / "slow"
    with Network(workdir) as net:
        head, fast, slow = net.add("head"), net.add("w1"), net.add("w2", shaped=True)
        address = start_ray(net, head, [fast, slow], workdir)
        args = [sys.executable, "-m", "shoal.cli", "run", "slow.yaml", "--address", address]
        driver = net.popen(head, [*args, "--run-name", "slow"], workdir / "driver.log", cwd=workdir)
        running = lambda: driver.poll() is None  # noqa: E731
        wait_for(lambda: newest_checkpoint(run_dir) >= 20 or not running(), 300, "20 steps on 2 nodes")
        assert running(), (workdir / "driver.log").read_text()[-3000:]
        net.shape(slow, delay_ms=50, jitter_ms=10)
        assert driver.wait(timeout=600) == 0, (workdir / "driver.log").read_text()[-3000:]
        assert "its link to the head takes" in (workdir / "driver.log").read_text()  # the terminal line

    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("quickstart").experiment_id])
    assert run.info.status == "FINISHED"
    assert loss_steps(client, run.info.run_id) == list(range(1, SLOW_LINK_STEPS + 1))  # it went on
    slow_links = [e for e in events(client, run.info.run_id, workdir) if e.get("cause") == "link"]
    assert slow_links and {e["node"] for e in slow_links} == {slow.address}, slow_links
    (rank,) = {e["rank"] for e in slow_links}
    assert slow_links[0]["kind"] == "straggler" and slow_links[0]["step"] > 20
    round_trips = {
        r: [m.value for m in client.get_metric_history(run.info.run_id, f"worker/{r}/link_rtt_s")]
        for r in (0, 1)
    }
    assert max(round_trips[rank]) >= 0.08 > max(round_trips[1 - rank])  # 2 x (50 ± 10) ms vs none
    print(f"slow link: rank {rank} on {slow.address}, event at step {slow_links[0]['step']}: {slow_links[0]}")
