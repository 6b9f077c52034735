"""The hang watchdog, in a real child process that stops making progress."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path


def test_a_hung_process_dumps_its_stacks_and_exits(tmp_path: Path) -> None:
    program = textwrap.dedent(
        f"""
        import time
        from shoal.worker.runtime import HangWatchdog

        def blocked_in_a_collective():
            time.sleep(60)

        dog = HangWatchdog(1.0, {str(tmp_path)!r}, rank=3)
        dog.arm()
        for _ in range(30):  # 1.5 s of steady progress, past the first countdown (1.1 s)
            time.sleep(0.05)
            dog.arm()
        blocked_in_a_collective()
        """
    )
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, timeout=30)
    assert result.returncode == 1
    dump = (tmp_path / "logs" / "hang-rank3.txt").read_text()
    assert "stacks follow if no step completes within 1 s" in dump
    assert "blocked_in_a_collective" in dump


def test_disarmed_watchdog_lets_the_process_finish(tmp_path: Path) -> None:
    program = (
        "import time\nfrom shoal.worker.runtime import HangWatchdog\n"
        f"dog = HangWatchdog(0.5, {str(tmp_path)!r}, rank=0)\n"
        "dog.arm()\ndog.disarm()\ntime.sleep(1)\n"
    )
    assert subprocess.run([sys.executable, "-c", program], timeout=30).returncode == 0
