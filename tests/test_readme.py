"""Every shell and Python block of README.md runs as written, next to the set-up daemon.

A new user copies the README's blocks in order, beside the daemon that the set-up command
started, with defaults and a fresh HOME. This test does the same: it starts that daemon
(the set-up block's last command, ``kvpool-server``) in a fresh HOME, then runs each other
block in its own shell or Python process with the same HOME, and stops every process a
block started, also when it fails.

A block may be marked with an HTML comment on the line before it:

* ``<!-- readme-test: setup -->``: an install-and-run command (the environment running
  this test was made by it); only its last command runs, as the daemon;
* ``<!-- readme-test: skip vllm -->`` / ``skip second-host``: needs vLLM or another host.

No other mark exists: a block that cannot run here fails this test.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

README = Path(__file__).resolve().parent.parent / "README.md"
SKIP_REASONS = {"vllm": "needs vLLM and a model", "second-host": "needs a second host"}
DAEMON_ADDRESS = ("127.0.0.1", 7700)
BLOCK_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Block:
    language: str
    code: str
    mark: str  # "" (run it), "setup", "skip <reason>"
    line: int
    section: str

    @property
    def id(self) -> str:
        slug = re.sub(r"[^a-z0-9]+", "-", self.section.lower()).strip("-")
        return f"{slug}-L{self.line}-{self.language}"


def readme_blocks(text: str) -> list[Block]:
    blocks: list[Block] = []
    lines = text.splitlines()
    section = "top"
    mark = ""
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            section = line.lstrip("#").strip()
        found = re.fullmatch(r"<!-- readme-test: (.+?) -->", line.strip())
        if found:
            mark = found.group(1).strip()
        opening = re.fullmatch(r"```(\w*)", line.strip())
        if opening:
            language, start = opening.group(1), i + 1
            i += 1
            while not lines[i].strip().startswith("```"):
                i += 1
            if language in ("sh", "python"):
                blocks.append(Block(language, "\n".join(lines[start:i]) + "\n", mark, start, section))
            mark = ""
        elif line.strip() and not found:
            mark = ""  # a mark applies to the block right below it only
        i += 1
    return blocks


BLOCKS = readme_blocks(README.read_text(encoding="utf-8"))


def test_every_block_is_run_or_skipped_for_a_known_reason() -> None:
    assert any(b.mark == "setup" for b in BLOCKS)
    for block in BLOCKS:
        if block.mark.startswith("skip "):
            assert block.mark[5:] in SKIP_REASONS, f"README line {block.line}: unknown skip reason {block.mark!r}"
        else:
            assert block.mark in ("", "setup"), f"README line {block.line}: unknown mark {block.mark!r}"


def test_the_setup_commands_are_the_ones_ci_runs() -> None:
    setup = [b.code.strip() for b in BLOCKS if b.mark == "setup"]
    ci = (README.parent / ".ci" / "run").read_text(encoding="utf-8")
    assert any(cmd.endswith("kvpool-server") for cmd in setup), "one set-up command runs the daemon"
    tests_command = next(cmd for cmd in setup if "pytest" in cmd)
    assert ci.rstrip().endswith(tests_command), ".ci/run must end with the README's test command, verbatim"


def _port_taken(address: tuple[str, int]) -> bool:
    with socket.socket() as probe:
        probe.settimeout(0.5)
        return probe.connect_ex(address) == 0


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XDG_", "KVPOOL_"))}
    env["HOME"] = str(home)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def _stop_group(process: subprocess.Popen[bytes], grace_s: float = 15.0) -> None:
    """SIGTERM to the process group a block ran in, then SIGKILL to what is left."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            try:
                os.killpg(process.pid, 0)
            except ProcessLookupError:
                return
            process.poll()
            time.sleep(0.05)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The set-up daemon: ``kvpool-server`` on the defaults, in a fresh HOME."""
    if _port_taken(DAEMON_ADDRESS):
        pytest.skip("127.0.0.1:7700 is taken: the README's blocks need the set-up daemon's default port")
    setup = next(b for b in BLOCKS if b.mark == "setup" and b.code.strip().endswith("kvpool-server"))
    command = setup.code.strip().rsplit("&&", 1)[1].strip()
    home = tmp_path_factory.mktemp("home")
    env = _env(home)
    log = (home / "daemon.log").open("wb")
    process = subprocess.Popen(command, shell=True, env=env, cwd=home, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            ready = subprocess.run(["kvpool", "stats"], env=env, cwd=home, capture_output=True, timeout=30)
            if ready.returncode == 0 and b"node" in ready.stdout:
                break
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the set-up daemon did not start:\n{(home / 'daemon.log').read_text(errors='replace')}")
            time.sleep(0.2)
        yield env
    finally:
        _stop_group(process)
        log.close()


RUNNABLE = [b for b in BLOCKS if b.mark == ""]
SKIPPED = [b for b in BLOCKS if b.mark.startswith("skip ")]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("block", RUNNABLE, ids=[b.id for b in RUNNABLE])
def test_readme_block_runs_as_written(block: Block, daemon: dict[str, str], tmp_path: Path) -> None:
    if block.language == "sh" and "etcd" in block.code and shutil.which("etcd") is None:
        pytest.skip("the etcd binary is missing (apt-get install etcd-server)")
    if block.language == "python" and "transformers" in block.code:
        pytest.importorskip("transformers")
        pytest.importorskip("torch")
    if block.language == "sh":
        argv = ["bash", "-e", "-o", "pipefail", "-c", block.code]
    else:
        argv = [sys.executable, "-c", block.code]
    process = subprocess.Popen(argv, env=daemon, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        output, _ = process.communicate(timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _stop_group(process)
        output, _ = process.communicate()
        pytest.fail(f"README line {block.line}: still running after {BLOCK_TIMEOUT_S} s:\n"
                    f"{output.decode(errors='replace')[-4000:]}")
    finally:
        _stop_group(process)
    assert process.returncode == 0, (f"README line {block.line} ({block.section}) exited {process.returncode}:\n"
                                     f"{output.decode(errors='replace')[-4000:]}")


@pytest.mark.parametrize("block", SKIPPED, ids=[b.id for b in SKIPPED])
def test_readme_block_that_needs_what_is_not_here(block: Block) -> None:
    pytest.skip(f"README line {block.line}: {SKIP_REASONS[block.mark[5:]]}")
