"""Fault injection: kill -9, pause or attack a live run; every run must finish with exact accounting.

    .venv/bin/python bench/faults.py --runs 20 --seed 0 [--faults kill,pause,hostile] [--out docs/faults-table.md]

Faults, one per run, taking ``--faults`` in turn:

* ``kill``: SIGKILL of a random rollout or trainer process;
* ``pause``: SIGSTOP of a random rollout or trainer for three heartbeat timeouts, then
  SIGCONT (a VM stall, a long GC pause): the node is declared lost and comes back;
* ``hostile``: a peer on loopback sends the coordinator the hostile messages of tests/hostile.py (spoofed
  StepDone/Consumed/VersionAnnounce/Hello, out-of-bounds Heartbeat stats, a Commit with
  fragment 99), says Hello as a rollout of its own, and sends the trainer's data socket chunks
  and commits for slots outside the run; every one must be refused. The messages come from
  the catalogue the tests share, ``tests/hostile.py``.

Each run is a real ``digenrl launch`` (tiny CPU config, 6-8 steps, checkpoint every step,
two rollouts and one trainer) in its own process group. After a random delay the bench
reads ``run_dir/logs/pids.json`` (the launcher keeps it current) and SIGKILLs one random
rollout or trainer process. A run passes when the launcher exits 0 having trained every
step and its summary.json shows no trajectory lost and no slot trained twice:

* ``admitted == trained + sum(discarded) + in_flight`` with ``in_flight == 0``;
* ``slots.consumed == slots.expected`` (steps x fragments): the ledger marks a slot consumed
  exactly once (it asserts on a second consume), so every (step, fragment) slot of the
  final weights was trained once;
* metrics.jsonl has one row per step.

Prints one Markdown table row per run and a final tally; timings are on a shared 2-core CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/hostile.py: the messages' catalogue

from digenrl.telemetry.metrics import read_metrics

SETS = ["model.path=\"random\"", "train.prompts_per_step=2", "train.group_size=2",
        "runtime.fragments_per_step=2", "sampler.num_steps=4", "run.checkpoint_every=1",
        "runtime.heartbeat_s=0.25", "runtime.heartbeat_misses=6",
        "run.eval_every=0"]  # faults, not the default's held-out evaluation


def _hostile_peer(endpoint: str) -> int:
    """Send the coordinator and (after a Hello of its own) a trainer rank what tests/hostile.py's
    adversary sends; returns how many messages it sent."""
    import zmq

    from digenrl.transport.protocol import Welcome, decode, encode
    from tests import hostile  # the repo root is on sys.path (top of this file)
    ctx = zmq.Context()
    sent = 0
    try:
        evil = ctx.socket(zmq.DEALER)
        evil.setsockopt(zmq.LINGER, 0)
        evil.connect(endpoint)
        for i in range(20):
            for m in hostile.coordinator_attack(i):
                evil.send_multipart(encode(m))
                sent += 1
        # a rollout of its own (loopback plain text admits any local process): it learns the
        # trainers' addresses and sends them work for slots that do not exist
        rogue = ctx.socket(zmq.DEALER)
        rogue.setsockopt(zmq.LINGER, 0)
        rogue.setsockopt(zmq.ROUTING_ID, b"rollout-evil")
        rogue.connect(endpoint)
        rogue.send_multipart(encode(hostile.hello("rollout-evil", "rollout")))
        if rogue.poll(30_000):
            msg = decode(rogue.recv_multipart(), max_frame_bytes=1 << 28)
            if isinstance(msg, Welcome):
                push = ctx.socket(zmq.PUSH)
                push.setsockopt(zmq.LINGER, 2000)
                push.connect(str(msg.endpoints["trainer/0"]).split("|")[0])
                for i in range(100):
                    m = hostile.trainer_attack(i, "rollout-evil")
                    push.send_multipart(encode(m))
                    sent += 1
                push.close()
        rogue.close()
        evil.close()
    finally:
        ctx.destroy(linger=0)  # term() alone would wait forever on a socket an error left open
    return sent


def one_run(i: int, rng: random.Random, root: Path, timeout: float, fault: str) -> dict:
    mode = rng.choice(["digenrl", "disagg-sync"])
    steps = rng.choice([6, 8])
    victim_role = rng.choice(["rollout", "trainer"])
    # steps take 0.3-3 s here (idle vs loaded machine): after step 0, kill within ~a second
    delay = rng.uniform(0.0, 1.0)
    run_dir = root / f"run{i:02d}"
    cmd = [sys.executable, "-m", "digenrl.cli", "launch", "--mode", mode, "--steps", str(steps),
           "--rollouts", "2", "--trainers", "1", "--run-dir", str(run_dir),
           *[a for s in SETS for a in ("--set", s)]]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    endpoint = ""
    for line in proc.stdout:  # type: ignore[union-attr]
        if "coordinator listening on" in line:
            endpoint = line.rsplit(" ", 1)[-1].strip()
            break
    victim, killed_at = "", None
    pid_file, metrics = run_dir / "logs" / "pids.json", run_dir / "metrics.jsonl"
    # a random moment: a quarter of the kills while nodes start up, the rest while training
    # (a hostile peer attacks as soon as the nodes exist: on an idle machine a run's steps take
    # 0.3 s, so an attack started after step 0 could land after the last step)
    early = rng.random() < 0.25 or fault == "hostile"
    ready = (lambda: pid_file.exists()) if early else (lambda: metrics.exists() and metrics.stat().st_size > 0)
    while not ready() and proc.poll() is None:
        time.sleep(0.1)
    try:
        proc.wait(timeout=delay)
    except subprocess.TimeoutExpired:
        pids = json.loads(pid_file.read_text())
        names = sorted(n for n in pids if n.startswith(victim_role))
        victim = rng.choice(names) if fault != "hostile" else "coordinator, trainer-0"
        try:
            if fault == "kill":
                os.kill(pids[victim], signal.SIGKILL)
            elif fault == "pause":
                os.kill(pids[victim], signal.SIGSTOP)
                killed_at = time.monotonic() - t0
                time.sleep(3 * 0.25 * 6)  # three heartbeat timeouts
                try:
                    os.kill(pids[victim], signal.SIGCONT)
                except ProcessLookupError:  # declared lost while stopped, and killed by the rewind
                    victim += " (killed by the launcher while paused)"
            else:
                killed_at = time.monotonic() - t0
                victim += f" ({_hostile_peer(endpoint)} messages)"
            if fault == "kill":
                killed_at = time.monotonic() - t0
        except ProcessLookupError:
            victim += " (already gone)"
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
    wall = time.monotonic() - t0
    row = {"run": i, "mode": mode, "steps": steps, "fault": fault, "victim": victim or "(run ended first)",
           "kill_s": killed_at, "wall_s": wall, "rc": proc.returncode}
    summary_path = run_dir / "summary.json"
    if proc.returncode != 0 or not summary_path.exists():
        row.update(ok=False, why=(err or "")[-400:].replace("\n", " "))
        return row
    s = json.loads(summary_path.read_text())
    acc = s["accounting"]
    disc = sum(acc["discarded"].values())
    rows = [r["step"] for r in read_metrics(run_dir)]  # train rows (evaluation rows apart)
    checks = {
        "steps": s["steps"] == steps,
        "adds_up": acc["admitted"] == acc["trained"] + disc + acc["in_flight"],
        "in_flight_0": acc["in_flight"] == 0,
        "slots_once": s["slots"]["consumed"] == s["slots"]["expected"],
        "metrics": rows == list(range(steps)),
    }
    # a killed node is restarted unless the run had ended; a paused or attacked one is not
    if fault == "kill" and victim and killed_at is not None and not s.get("restarts", {}).get(victim):
        row["victim"] = f"{victim} (after the last step)"
    row.update(ok=all(checks.values()), failed=[k for k, v in checks.items() if not v],
               lost=acc["admitted"] - acc["trained"] - disc - acc["in_flight"],
               refused=sum(s.get("refused", {}).values()) if isinstance(s.get("refused"), dict) else 0,
               admitted=acc["admitted"], trained=acc["trained"], discarded=dict(acc["discarded"]),
               in_flight=acc["in_flight"], slots=f"{s['slots']['consumed']}/{s['slots']['expected']}",
               recovery={k: v for k, v in s["recovery"].items() if v}, restarts=s.get("restarts", {}),
               zombies=s["scheduler"].get("zombie_consumes", 0) + s["scheduler"].get("zombie_commits", 0))
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds a run may take after the kill")
    ap.add_argument("--keep", default=None, help="keep run dirs under this folder")
    ap.add_argument("--out", default=None, help="also write the table (Markdown) here")
    ap.add_argument("--faults", default="kill,pause,hostile", help="faults to draw from")
    args = ap.parse_args()
    faults = args.faults.split(",")
    rng = random.Random(args.seed)
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="digenrl-faults-"))
    root.mkdir(parents=True, exist_ok=True)
    lines = ["| run | mode | steps | fault | victim | at s | wall s | admitted | trained | discarded | "
             "in flight | lost | slots | recovery | ok |", "|" + "---|" * 15]
    print("\n".join(lines), flush=True)
    results = []
    for i in range(args.runs):
        r = one_run(i, rng, root, args.timeout, faults[i % len(faults)])  # each fault in turn
        results.append(r)
        kill = f"{r['kill_s']:.1f}" if r["kill_s"] is not None else "-"
        disc = ", ".join(f"{k} {v}" for k, v in sorted(r.get("discarded", {}).items())) or "0"
        rec = ", ".join([*(f"{k} {v}" for k, v in sorted(r.get("recovery", {}).items())
                           if k != "checkpoints"), *([f"refused {r['refused']}"] if r.get("refused") else [])]) or "-"
        ok = "yes" if r["ok"] else f"NO {r.get('failed') or r.get('why')}"
        line = (f"| {r['run']} | {r['mode']} | {r['steps']} | {r['fault']} | {r['victim']} | {kill} | "
                f"{r['wall_s']:.0f} | {r.get('admitted', '-')} | {r.get('trained', '-')} | {disc} | "
                f"{r.get('in_flight', '-')} | {r.get('lost', '-')} | {r.get('slots', '-')} | {rec} | {ok} |")
        lines.append(line)
        print(line, flush=True)
    n_ok = sum(r["ok"] for r in results)
    n_kill = sum(r["kill_s"] is not None for r in results)
    lost = sum(r.get("lost", 0) for r in results)
    tally = (f"{n_ok}/{len(results)} runs passed; {n_kill} had their fault injected mid-run; "
             f"trajectories lost: {lost}; run dirs in {root}")
    print(tally, flush=True)
    if args.out:
        Path(args.out).write_text("\n".join([*lines, "", tally, ""]))
    return 0 if n_ok == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
