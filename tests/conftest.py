"""Helpers shared by the test modules.

Exact float equality, the suite's rule
--------------------------------------
CI machines of this project's kind differ in CPU (AMD EPYC, Intel Xeon), and a kernel may
round differently with another CPU, another thread count, or another memory alignment of the
same data. So:

* **exact** (``torch.equal``, ``==``) where exactness is the point and the arithmetic is the
  same: bits that are stored and read back (weights, checkpoints, frames on the wire, RNG
  states), one instance on one input in one process (ratio == 1 on recompute), elementwise
  math with no reductions, and a resumed run against an uninterrupted one on the same machine
  with the same thread count (resume must replay the same arithmetic);
* **a tolerance** whenever two different module instances, two code paths, two processes
  that are not replaying each other, or thread counts are compared. Weights are then still
  compared exactly (:func:`assert_same_weights`), and the outputs with
  :func:`assert_close_across_instances`.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import settings

from digenrl.faults import CRASH_ENV, HANG_ENV, NAN_ENV, SIGNAL_ENV

#: Property tests draw the same examples on every run (``derandomize``), so the suite's verdict
#: on a commit does not depend on luck (a random draw once turned up, by chance, a disagreement
#: that earlier runs had missed). ``DIGENRL_HYPOTHESIS=explore ./dev.sh test -m "not slow"``
#: draws fresh examples each run, to go looking for such cases (a loop of those is cheap).
settings.register_profile("suite", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False, database=None)
settings.load_profile(os.environ.get("DIGENRL_HYPOTHESIS", "suite"))

#: torch intra-op threads for the whole suite: in this process (an autouse fixture) and in
#: every run it launches (:data:`SUITE_SETS`). CPU kernels may round differently at another
#: thread count, so the suite is run once at 1 and once at 2 before a change of tolerances
#: lands: ``DIGENRL_TEST_THREADS=2 ./dev.sh test``.
TEST_THREADS = int(os.environ.get("DIGENRL_TEST_THREADS", "1"))

#: The suite's departures from the embedded default config, for every run it loads or
#: launches (later overrides win, so a test that wants one of these sets it itself): the
#: suite's thread count (:data:`THREAD_SETS`, all a ``--resume`` gets: the run's config.toml
#: holds the rest); the old default's 60 steps; no held-out evaluation nor test split (the default evaluates 640 samples at the start
#: and the end, its 5-minute demo that bench/learning.py measures: it would add half a minute
#: or more to each of the suite's launches); a full fine-tune without the base model's tail
#: (the mechanisms' tests compare whole weight sets, and LoRA has tests of its own); and the
#: prompt-agnostic JPEG reward (tests feed prompts outside the shapes grammar, which the
#: default's judge refuses); no KL term (the default's keeps its demo's diversity; on a full
#: fine-tune it would hold a second copy of the model as the reference). The autouse fixture :func:`_suite_default` gives the same to
#: ``load_config(None, ...)`` in this process. tests/test_config.py checks the shipped default
#: and tests/test_evaluate.py launches it.
THREAD_SETS = [f"run.threads={TEST_THREADS}"]
SUITE_SETS = [*THREAD_SETS, "run.steps=60", "run.eval_every=0", 'prompts.test_file=""', "model.lora_rank=0",
              "sampler.base_tail=0", 'reward.terms=[{ name = "jpeg_compressibility", weight = 1.0 }]',
              "train.kl_beta=0.0"]

#: The small run most launch tests start from (later overrides win): the tiny random model,
#: 2 prompts x 2 generations cut into 2 fragments, 4 denoising steps, the suite's threads.
SMALL = [*SUITE_SETS, 'model.path="random"', "train.prompts_per_step=2", "train.group_size=2",
         "runtime.fragments_per_step=2", "sampler.num_steps=4"]


@pytest.fixture(autouse=True)
def _suite_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """``load_config(None, ...)`` in this process starts from the default with
    :data:`SUITE_SETS` applied; a test's own overrides still come after."""
    import digenrl.config as config

    monkeypatch.setattr(config, "default_config_text", _suite_default_text)


@functools.cache
def _suite_default_text() -> str:
    """The default config with :data:`SUITE_SETS` as TOML, built once for the whole session
    (from the repository's copy of the embedded default, which tests/test_config.py checks is
    the same file: load_config(None) would read the patched text)."""
    from digenrl.config import load_config, to_toml

    return to_toml(load_config(Path(__file__).resolve().parents[1] / "configs" / "tiny-cpu.toml", SUITE_SETS))


@pytest.fixture(autouse=True)
def _torch_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(TEST_THREADS)
    yield
    torch.set_num_threads(before)

#: Two instances holding identical float32 weights: differences seen are ~1e-7 relative (the
#: last bit or two of a matmul or conv); a real difference in weights or conventions moves
#: outputs by orders of magnitude more.
INSTANCE_RTOL = 1e-5
INSTANCE_ATOL = 1e-6


def assert_same_weights(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> None:
    """Two state dicts hold the same keys and bit-identical tensors."""
    assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))
    for k in a:
        assert torch.equal(a[k], b[k]), k


def assert_close_across_instances(a: torch.Tensor, b: torch.Tensor) -> None:
    """Outputs of two module instances with identical weights, on the same input."""
    torch.testing.assert_close(a, b, rtol=INSTANCE_RTOL, atol=INSTANCE_ATOL)


# ----------------------------------------------------------------------------- waiting


def wait_until(cond: Callable[[], bool], what: str, timeout: float, poll_s: float = 0.2) -> None:
    """Poll ``cond`` (another process's files or state, which nothing can signal) until it
    holds; the timeout only bounds a broken run and names ``what`` was awaited."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(poll_s)


async def wait_until_async(cond: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    """:func:`wait_until` inside an event loop, for state the loop's own tasks change."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


# ----------------------------------------------------------------------------- launched runs


def set_args(sets: Sequence[str]) -> list[str]:
    """``--set KEY=VALUE`` command-line pairs."""
    return [a for s in sets for a in ("--set", s)]


def launch_command(*args: str, sets: Sequence[str] = ()) -> list[str]:
    """``python -m digenrl.cli launch ARGS`` with :data:`SUITE_SETS` (a resume: the thread count
    only) and ``sets``."""
    base = THREAD_SETS if "--resume" in args else SUITE_SETS
    # the suite's sets first: a --set among ARGS must win over them
    return [sys.executable, "-m", "digenrl.cli", "launch", *set_args(base), *args, *set_args(sets)]


def launch_env(*, crash: str = "", hang: str = "", sigterm: str = "", nan: str = "") -> dict[str, str]:
    """A launched run's environment: one OpenMP thread; a fault point (digenrl/faults.py)
    only where asked, never one inherited from the test's own environment."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for var, spec in ((CRASH_ENV, crash), (HANG_ENV, hang), (SIGNAL_ENV, sigterm), (NAN_ENV, nan)):
        env.pop(var, None)
        if spec:
            env[var] = spec
    return env


def launch_run(*args: str, sets: Sequence[str] = (), crash: str = "", hang: str = "",
               timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run ``digenrl launch`` to its end as a user would; its output captured. A session of
    its own: a crash point kills the launcher's whole process group, not the test's."""
    return subprocess.run(launch_command(*args, sets=sets), env=launch_env(crash=crash, hang=hang),
                          start_new_session=True, capture_output=True, text=True, timeout=timeout,
                          check=False)


def shared_dir(factory: pytest.TempPathFactory, name: str, make: Callable[[Path], None]) -> Path:
    """A folder ``make`` fills once per test session, for every test (and every pytest-xdist
    worker) that asks for ``name``: a launched run several tests read instead of each launching
    the same config. The first caller runs ``make(folder)`` under a file lock while the others
    wait for it; a ``make`` that raised leaves no mark, so the next caller fails the same way
    (or runs it again) instead of reading half a run."""
    base = factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared"
    root.mkdir(exist_ok=True)
    folder, done = root / name, root / f"{name}.done"
    with (root / f"{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not done.exists():
            if folder.exists():
                import shutil
                shutil.rmtree(folder)
            folder.mkdir()
            make(folder)
            done.touch()
    return folder


#: The shared runs of :func:`mode_run`: the small run in each mode, ``digenrl`` long enough to
#: move weights to the rollout while it generates, with fast heartbeats (tests read the
#: busy fractions of the last ones).
MODE_RUN_STEPS = {"digenrl": 4, "disagg-sync": 2, "colocated": 2}
MODE_RUN_HEARTBEAT_S = 0.1
MODE_RUN_SETS = [*SMALL, f"runtime.heartbeat_s={MODE_RUN_HEARTBEAT_S}", "runtime.heartbeat_misses=50"]


def mode_run(factory: pytest.TempPathFactory, mode: str) -> tuple[Path, subprocess.CompletedProcess[bytes]]:
    """The small run in ``mode`` (:data:`MODE_RUN_STEPS` steps), launched once per session as a
    user would (``digenrl launch``, stdout and stderr pipes), shared by the tests that read a
    finished run: its run folder and the launcher's completed process."""
    def make(folder: Path) -> None:
        cmd = launch_command("--mode", mode, "--steps", str(MODE_RUN_STEPS[mode]), "--run-dir",
                             str(folder / "run"), sets=MODE_RUN_SETS)
        proc = subprocess.run(cmd, capture_output=True, timeout=600, check=False, env=launch_env())
        (folder / "stdout").write_bytes(proc.stdout)
        (folder / "stderr").write_bytes(proc.stderr)
        assert proc.returncode == 0, proc.stderr.decode(errors="replace")[-3000:]

    folder = shared_dir(factory, f"mode-run-{mode}", make)
    proc = subprocess.CompletedProcess(["digenrl", "launch", "--mode", mode], 0,
                                       (folder / "stdout").read_bytes(), (folder / "stderr").read_bytes())
    return folder / "run", proc


def node_final(log: Path) -> dict[str, Any]:
    """The ``node_final`` record a node logs on exit (JSON lines); a node that left without it
    (killed, or a hard exit) fails the assertion."""
    finals = [json.loads(x) for x in log.read_text().splitlines() if '"node_final"' in x]
    assert finals, f"{log} has no node_final line"
    return dict(finals[-1])


def datagrams(sock: socket.socket) -> list[str]:
    """Every datagram waiting on a non-blocking socket (a stand-in for systemd's notify
    socket), decoded, in arrival order."""
    out = []
    while True:
        try:
            out.append(sock.recv(4096).decode())
        except BlockingIOError:
            return out


def processes_of(run_dir: Path) -> list[int]:
    """Live (not zombie) processes whose command line names ``run_dir``: a run's nodes."""
    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            with contextlib.suppress(OSError):
                cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                state = (p / "stat").read_text().split(") ", 1)[1][:1]
                if str(run_dir) in cmd and state != "Z":
                    pids.append(int(p.name))
    return pids


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The trained policy a run left in ``run_dir/final``."""
    from safetensors.torch import load_file
    return load_file(run_dir / "final" / "policy.safetensors")


HEAVY_MODULES = ("diffusers", "peft", "transformers")


def heavy_imports_after(code: str) -> list[str]:
    """Which of :data:`HEAVY_MODULES` (seconds of CPU to import, with torch._dynamo) are
    loaded once ``code`` has run in a fresh interpreter at the repository root."""
    probe = (f"{code}\nimport json, sys\n"
             f"print(json.dumps(sorted(m for m in {HEAVY_MODULES!r} if m in sys.modules)))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr[-2000:]
    loaded: list[str] = json.loads(out.stdout.strip().splitlines()[-1])
    return loaded


def bare_coordinator(tmp_path: Path, sets: Sequence[str] = (), trainers: int = 1) -> Any:
    """A CoordinatorActor with no sockets (control and pub None), for tests that call its
    decisions directly: the run's config with ``sets``, ``trainers`` expected."""
    import structlog

    from digenrl.actors.cluster import make_scheduler
    from digenrl.actors.coordinator import CoordinatorActor
    from digenrl.config import load_config, resolve_mode
    from digenrl.telemetry.trace import SpanRecorder
    cfg = resolve_mode(load_config(None, [*sets, f"cluster.trainers={trainers}"]))
    return CoordinatorActor(cfg=cfg, scheduler=make_scheduler(cfg, prompt_count=8), control=None,
                            pub=None, prompts=[], run_dir=tmp_path, dist_endpoint="tcp://127.0.0.1:1",
                            metrics=None, expected_trainers=trainers, node_id="coordinator",
                            recorder=SpanRecorder("coordinator", "coordinator"),
                            log=structlog.get_logger())

