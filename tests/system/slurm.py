"""A Slurm cluster of a test's own, in the network namespaces of netns.py: `slurmctld` on a
controller node, one `slurmd` per compute node, and a `munged` with its own key and socket.

Every file (configuration, key, socket, state, spool, logs, hosts) is under the test's scratch
directory. Each daemon runs in its node's network namespace as a host of its own (a UTS
namespace named like the node, a mount namespace whose /etc/hosts names every node); every
address is on the namespaces' links. The daemons and everything the jobs start are processes
in those namespaces, so `Network.close()` ends them all. Nothing outside the scratch directory
is written, but the packages where the test installs them.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from tests.system.netns import Network, Node

PACKAGES = ("munge", "slurmctld", "slurmd", "slurm-client")
COMMANDS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel", "sinfo")
SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
INSTALL_TIMEOUT_S = 600
COMMAND_TIMEOUT_S = 30
KILL_WAIT_S = 60
TOOLS = ("nsenter", "unshare", "mount", "hostname")  # util-linux and hostname: a node's namespaces
POLICY_RC = Path("/usr/sbin/policy-rc.d")  # what invoke-rc.d asks before starting a service


def _missing() -> list[str]:
    return [command for command in COMMANDS if shutil.which(command, path=SEARCH_PATH) is None]


def _install() -> str | None:
    """apt-get install the packages, their services kept from starting; None or the error."""
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    added_policy = not POLICY_RC.exists()
    if added_policy:  # the packages would start a global munged, slurmctld and slurmd
        POLICY_RC.write_text("#!/bin/sh\nexit 101\n")
        POLICY_RC.chmod(0o755)
    install = ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]
    try:
        for attempt in (install, ["apt-get", "update"], install):  # update only when needed
            done = subprocess.run(attempt, capture_output=True, text=True, env=env, timeout=INSTALL_TIMEOUT_S)
            if done.returncode == 0 and attempt is install:
                return None
        lines = (done.stderr or done.stdout).strip().splitlines()
        return lines[-1] if lines else f"exit status {done.returncode}"
    except (OSError, subprocess.SubprocessError) as exc:
        return str(exc)
    finally:
        if added_policy:
            POLICY_RC.unlink(missing_ok=True)


def why_not_available() -> str | None:
    """None where Slurm and munge are installed (installing them if missing), else why not."""
    tools = [tool for tool in TOOLS if shutil.which(tool, path=SEARCH_PATH) is None]
    if tools:
        return f"{', '.join(tools)} not found"
    missing = _missing()
    if not missing:
        return None
    if os.geteuid() != 0:
        return f"Slurm is not installed ({', '.join(missing)} missing) and installing it needs root"
    if shutil.which("apt-get") is None:
        return f"Slurm is not installed ({', '.join(missing)} missing) and there is no apt-get"
    error = _install()
    if error is not None:
        return f"`apt-get install {' '.join(PACKAGES)}` failed: {error}"
    missing = _missing()
    return f"the installed Slurm lacks {', '.join(missing)}" if missing else None


def _which(command: str) -> str:
    found = shutil.which(command, path=SEARCH_PATH)
    assert found is not None, f"{command} is not installed"
    return found


def wait_until(
    predicate: Callable[[], bool], timeout_s: float, what: str, detail: Callable[[], str] = lambda: ""
) -> None:
    """Polls `predicate` once a second (each poll may start a Slurm client) for at most `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}\n{detail()}")
        time.sleep(1)


class SlurmCluster:
    """`start()` brings it up; `command` runs a Slurm client on the controller node."""

    def __init__(self, net: Network, controller: Node, nodes: list[Node], cpus: int, memory_mb: int) -> None:
        self.net, self.controller, self.nodes = net, controller, nodes
        self.cpus, self.memory_mb = cpus, memory_mb
        self.root = net.scratch / "slurm"
        self.conf = self.root / "slurm.conf"
        self.socket = self.root / "munge" / "munge.socket"
        self.hosts = self.root / "hosts"
        self.names = {self.name(node): node for node in [controller, *nodes]}

    def name(self, node: Node) -> str:
        """The node's Slurm name and host name: its namespace's name without the test's tag."""
        return node.namespace.removeprefix(f"{self.net.tag}-")

    def env(self, **extra: str) -> dict[str, str]:
        return self.net.env(SLURM_CONF=str(self.conf), **extra)

    def start(self, timeout_s: float = 90) -> None:
        for directory in ("munge", "state", "logs", *(f"spool-{self.name(n)}" for n in self.nodes)):
            (self.root / directory).mkdir(parents=True, exist_ok=True)
        hosts = ["127.0.0.1 localhost", *(f"{node.address} {name}" for name, node in self.names.items())]
        self.hosts.write_text("\n".join(hosts) + "\n")
        self._start_munge()
        self.conf.write_text(self._config())
        self.daemon(self.controller, [_which("slurmctld"), "-D", "-f", str(self.conf)], "slurmctld")
        for node in self.nodes:
            slurmd = [_which("slurmd"), "-D", "-f", str(self.conf), "-N", self.name(node)]
            self.daemon(node, slurmd, f"slurmd-{self.name(node)}")
        self._wait_until_idle(timeout_s)

    def daemon(self, node: Node, command: list[str], name: str) -> subprocess.Popen:
        """`command` in `node`'s network namespace as a host of its own. (Not `ip netns exec`:
        it mounts a /sys without the cgroup filesystems, and slurmd will not start without.)"""
        quoted = " ".join(f"'{part}'" for part in command)
        inside = f"mount --bind '{self.hosts}' /etc/hosts && hostname {self.name(node)} && exec {quoted}"
        with (self.root / "logs" / f"{name}.out").open("w") as log:
            process = subprocess.Popen(
                ["nsenter", f"--net=/run/netns/{node.namespace}", "unshare", "--uts", "--mount",
                 "--propagation=private", "sh", "-c", inside],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=self.env(),
            )  # fmt: skip
        self.net.processes.append(process)  # Network.close() ends it and what it started
        return process

    def _start_munge(self) -> None:
        munge = self.root / "munge"
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        # --force: munged refuses a socket that not every user can reach; here all are root's.
        munged = [
            _which("munged"), "--foreground", "--force", f"--socket={self.socket}",
            f"--key-file={key}", f"--pid-file={munge / 'munged.pid'}",
            f"--seed-file={munge / 'munged.seed'}", f"--log-file={munge / 'munged.log'}",
        ]  # fmt: skip
        self.daemon(self.controller, munged, "munged")
        wait_until(
            self.socket.is_socket,
            30,
            "munged's socket",
            lambda: (self.root / "logs" / "munged.out").read_text(),
        )

    def _config(self) -> str:
        root, ctl = self.root, self.controller
        lines = [
            "ClusterName=shoaltest",
            f"SlurmctldHost={self.name(ctl)}({ctl.address})",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.socket}",
            f"StateSaveLocation={root / 'state'}",
            f"SlurmdSpoolDir={root / 'spool-%n'}",
            f"SlurmctldPidFile={root / 'slurmctld.pid'}",
            f"SlurmdPidFile={root / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={root / 'logs' / 'slurmctld.log'}",
            f"SlurmdLogFile={root / 'logs' / 'slurmd-%n.log'}",
            "ProctrackType=proctrack/linuxproc",  # no cgroups made in the host's hierarchy
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "ReturnToService=2",
            # scancel: SIGTERM, then SIGKILL this much later (Slurm's default is 30 s): long
            # enough that a test sees the job's own processes end, not Slurm kill them
            f"KillWait={KILL_WAIT_S}",
            "MinJobAge=600",  # a finished job stays in `scontrol show job`
        ]
        for node in self.nodes:
            lines.append(
                f"NodeName={self.name(node)} NodeAddr={node.address} CPUs={self.cpus} "
                f"RealMemory={self.memory_mb} State=UNKNOWN"
            )
        nodes = ",".join(self.name(node) for node in self.nodes)
        lines.append(f"PartitionName=test Nodes={nodes} Default=YES MaxTime=INFINITE State=UP")
        return "\n".join(lines) + "\n"

    def _wait_until_idle(self, timeout_s: float) -> None:
        def idle() -> bool:
            done = self.command("sinfo", "--noheader", "--Node", "--format=%N %T")
            states = dict(line.split() for line in done.stdout.splitlines() if line.strip())
            return done.returncode == 0 and all(states.get(self.name(n)) == "idle" for n in self.nodes)

        wait_until(idle, timeout_s, "every slurmd to register as idle", self.logs)

    def logs(self) -> str:
        """The tail of each daemon's log, for a failure's message."""
        files = sorted((self.root / "logs").iterdir())
        return "\n".join(f"--- {path.name}:\n{path.read_text()[-1500:]}" for path in files)

    def command(self, *args: str, timeout_s: float = COMMAND_TIMEOUT_S) -> subprocess.CompletedProcess:
        """A Slurm client command on the controller node, configured for this cluster."""
        return subprocess.run(
            ["ip", "netns", "exec", self.controller.namespace, _which(args[0]), *args[1:]],
            capture_output=True, text=True, timeout=timeout_s, env=self.env(),
        )  # fmt: skip

    def sbatch(
        self, script: Path, options: list[str], args: list[str], cwd: Path, env: dict[str, str]
    ) -> str:
        """Submits `script` from `cwd`, `env` its environment (sbatch exports it to the job); the job id."""
        done = subprocess.run(
            ["ip", "netns", "exec", self.controller.namespace, _which("sbatch"), "--parsable",
             *options, str(script), *args],
            cwd=cwd, env={**self.env(), **env}, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S,
        )  # fmt: skip
        assert done.returncode == 0, f"sbatch failed: {done.stderr}"
        return done.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job`'s fields (JobState, ExitCode, NodeList, ...); {} once it is gone."""
        done = self.command("scontrol", "--oneliner", "show", "job", job_id)
        return dict(re.findall(r"(\w+)=(\S*)", done.stdout)) if done.returncode == 0 else {}

    def wait_for_job(self, job_id: str, states: set[str], timeout_s: float) -> dict[str, str]:
        """The job's fields once its state is one of `states`."""
        fields: dict[str, str] = {}

        def reached() -> bool:
            fields.update(self.job(job_id))
            return fields.get("JobState") in states

        wait_until(
            reached, timeout_s, f"job {job_id} to be {' or '.join(sorted(states))}", lambda: str(fields)
        )
        return fields
