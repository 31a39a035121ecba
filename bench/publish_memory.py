"""Host memory of sharded trainer ranks while a weight version is gathered for publishing.

    .venv/bin/python bench/publish_memory.py [--mib 1024] [--ranks 2] [--repeats 2] [--json]

Every optimizer step, FSDP trainer ranks gather the whole weight set (one all-gather per
tensor, a collective) so that rank 0 can publish it. ``keep_all`` is what every rank did
before: each kept a host copy of every gathered tensor, then all but rank 0 threw it away;
``keep_rank0`` is what ``Policy.state_dict_for_sync(keep=rank == 0)`` does now: the other
ranks join each gather and drop the tensor at once. The model is the FLUX recipe on
``model.path = "emulated"`` with its weight set scaled to ``--mib`` MiB of float32 (tensors of
4 MiB, one FSDP unit), ``--ranks`` real processes over gloo on this machine. Each
(mode, repeat) is a fresh group of processes (an allocator that kept the last run's pages
would hide the next one's), modes interleaved; medians of ``--repeats``. The workers run with
glibc's mmap threshold fixed at 64 KiB, so that resident memory follows the live tensors.

Per rank: ``extra_peak_mib``, the resident memory a sampler thread (every 2 ms) saw above
the rank's resident memory just before the gather, and ``gather_s``. Keys:
``rank0_extra_peak_mib_<mode>``, ``other_ranks_extra_peak_mib_<mode>`` (the largest of ranks
1..N-1), ``gather_s_<mode>`` (rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODES = ("keep_all", "keep_rank0")
PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE / 2**20


def worker(rank: int, world: int, mode: str, mib: int, store: str) -> None:
    import torch
    import torch.distributed as dist

    from digenrl.config import load_config
    from digenrl.core import costmodel as cm
    from digenrl.models.emulated import _spec
    from digenrl.rl.policy import build_policy

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    base = load_config("configs/models/flux.toml", ['model.path="emulated"', 'model.dtype="float32"',
                                                    "model.lora_rank=0", "model.fsdp=true"])
    scale = (mib << 20) / cm.trainable_bytes(_spec(base.model), 0)
    cfg = load_config("configs/models/flux.toml", ['model.path="emulated"', 'model.dtype="float32"',
                                                   "model.lora_rank=0", "model.fsdp=true",
                                                   f"model.emulate.weight_scale={scale!r}",
                                                   "model.emulate.latent_scale=0.004"])
    policy = build_policy(cfg, world_size=world, gpu="H100")
    dist.barrier()
    before = _rss_mib()
    peak = [before]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.002):
            peak[0] = max(peak[0], _rss_mib())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    sd = policy.state_dict_for_sync(keep=True if mode == "keep_all" else rank == 0)
    if rank != 0:
        del sd  # what the publish did with it on these ranks
    seconds = time.perf_counter() - t0
    peak[0] = max(peak[0], _rss_mib())
    done.set()
    sampler.join()
    dist.barrier()
    print(json.dumps({"rank": rank, "extra_peak_mib": peak[0] - before, "gather_s": seconds,
                      "rss_before_mib": before}), flush=True)
    dist.destroy_process_group()


def run_once(mode: str, ranks: int, mib: int) -> list[dict[str, float]]:
    with tempfile.TemporaryDirectory() as tmp:
        store = str(Path(tmp) / "store")
        # a fixed mmap threshold: every tensor-sized block is mapped on malloc and unmapped on
        # free, so resident memory follows live tensors (glibc's sliding threshold would keep
        # the model build's freed pages resident and the gather would reuse them unseen)
        env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536")
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), str(ranks), mode, str(mib),
                                   store], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                 for r in range(ranks)]
        outs = [p.communicate(timeout=1800) for p in procs]
    for p, (_, err) in zip(procs, outs):
        if p.returncode != 0:
            raise SystemExit(f"a rank failed ({mode}): {err[-2000:]}")
    rows = [json.loads(next(line for line in out.splitlines() if line.startswith("{"))) for out, _ in outs]
    return sorted(rows, key=lambda r: r["rank"])


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        rank, world, mode, mib, store = sys.argv[2:7]
        worker(int(rank), int(world), mode, int(mib), store)
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=1024, help="the weight set, MiB of float32")
    ap.add_argument("--ranks", type=int, default=2, help="FSDP trainer ranks (processes, gloo)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.ranks < 2:
        raise SystemExit(f"--ranks {args.ranks}: at least 2 (one publishes, the others only join)")
    got: dict[str, list[list[dict[str, float]]]] = {m: [] for m in MODES}
    for rep in range(args.repeats):
        for mode in (MODES if rep % 2 == 0 else MODES[::-1]):
            rows = run_once(mode, args.ranks, args.mib)
            got[mode].append(rows)
            print(f"# repeat {rep} {mode:10s} " + "  ".join(
                f"rank {r['rank']}: +{r['extra_peak_mib']:.0f} MiB {r['gather_s']:.2f} s" for r in rows),
                file=sys.stderr, flush=True)
    out: dict[str, object] = {"set_mib": args.mib, "ranks": args.ranks, "repeats": args.repeats}
    for mode in MODES:
        runs = got[mode]
        out[f"rank0_extra_peak_mib_{mode}"] = statistics.median(r[0]["extra_peak_mib"] for r in runs)
        out[f"other_ranks_extra_peak_mib_{mode}"] = statistics.median(
            max(x["extra_peak_mib"] for x in r[1:]) for r in runs)
        out[f"gather_s_{mode}"] = statistics.median(r[0]["gather_s"] for r in runs)
    if args.json:
        print(json.dumps(out, indent=1))
        return
    print("| mode | rank 0 extra peak MiB | other ranks' extra peak MiB | gather s (rank 0) |\n|---|---|---|---|")
    for mode in MODES:
        print(f"| {mode} | {out[f'rank0_extra_peak_mib_{mode}']:.0f} | "
              f"{out[f'other_ranks_extra_peak_mib_{mode}']:.0f} | {out[f'gather_s_{mode}']:.2f} |")


if __name__ == "__main__":
    main()
