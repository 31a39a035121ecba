"""The planner's paper table: every recipe on the 16/32-GPU testbeds, each mode over colocated.

    .venv/bin/python bench/paper_table.py [--json bench/results/paper_table.json]

For each ``configs/models/*.toml`` x ``configs/clusters/{h800-16,h800-32,mixed-*}.toml``:
``digenrl.sim.plan.plan(cfg, cluster, ["colocated", "disagg-sync", "digenrl"], search=True)``,
i.e. ``digenrl plan --config MODEL --cluster CLUSTER --search``, printed as the markdown rows
of docs/benchmarks.md ("Predicted speed-up over colocated"): colocated s/step, each mode's
and ablation's speed-up over it, and the best split of the search.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from digenrl.config import load_config
from digenrl.sim.cluster import load_cluster
from digenrl.sim.plan import plan

ROOT = Path(__file__).resolve().parents[1]
MODELS = {"flux": "FLUX.1 720px", "wan": "Wan2.1-14B 480p", "hunyuanvideo": "HunyuanVideo 480x480x53f",
          "qwenimage": "Qwen-Image 512px LoRA"}
CLUSTERS = {"h800-16": "16 x H800", "h800-32": "32 x H800", "mixed-h100-h20-32": "32 mixed H100 + H20",
            "mixed-h100-l40s-16": "16 mixed H100 + L40S"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None, metavar="PATH", help="also write every report here")
    args = ap.parse_args()
    rows, reports = [], {}
    t0 = time.perf_counter()
    for m, mname in MODELS.items():
        cfg = load_config(ROOT / "configs" / "models" / f"{m}.toml")
        for c, cname in CLUSTERS.items():
            r = plan(cfg, load_cluster(ROOT / "configs" / "clusters" / f"{c}.toml"),
                     ["colocated", "disagg-sync", "digenrl"], search=True)
            r.pop("_results")
            reports[f"{m}/{c}"] = r
            x = {row["name"]: row["speedup_vs_colocated"] for row in r["modes"] + r["ablation"]}
            best = r["search"]["best"]
            rows.append(f"| {mname} | {cname} | {r['modes'][0]['s_per_step']:.0f} | {x['disagg-sync']:.2f} | "
                        f"{x['digenrl']:.2f} | {x['digenrl -tsp']:.2f} | {x['digenrl -relay']:.2f} | "
                        f"{best['speedup_vs_colocated']:.2f} ({best['trainers']}/{best['rollouts']}, "
                        f"{'on' if best['tsp'] else 'off'}) |")
            print(rows[-1], flush=True)
    print(f"# {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(reports, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
