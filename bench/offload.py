"""model.offload = "optimizer" against "none": a trainer step's device memory and time.

    .venv/bin/python bench/offload.py [--layers 4] [--heads 4] [--dtype bfloat16] [--repeats 7] [--json]

A random SD3 transformer (the tiny config, ``--layers`` blocks of ``--heads`` x 16 channels),
fully fine-tuned in ``--dtype`` (bfloat16: float32 masters), one training pass (2 samples, 2
trained timesteps) and one optimizer step per repeat, the two modes interleaved; medians.

Device bytes: on a GPU measured (``torch.cuda.memory_allocated`` between passes, with the
gradients held, and the step's peak, each above the allocation before the policy was built);
on a CPU, where host and device are one memory, counted from the tensors by where the mode
keeps them (the model's parameters and gradients, device masters, AdamW state on the device).
The weights after the repeats are compared: equal bit for bit on a CPU (the same kernels),
to float32 rounding on a GPU (CPU against CUDA AdamW).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

MODES = ("none", "optimizer")


def _bytes(tensors: Any) -> int:
    return sum(t.untyped_storage().nbytes() if t.stride() and 0 in t.stride() else t.numel() * t.element_size()
               for t in tensors)


def _policy(mode: str, args: argparse.Namespace, device: torch.device) -> tuple[Any, Any]:
    from digenrl.config import load_config
    from digenrl.models import build_model
    from digenrl.rl.policy import Policy

    cfg = load_config(None, ['model.path="random"', 'model.family="sd3"', f'model.dtype="{args.dtype}"',
                             "model.lora_rank=0", f'model.offload="{mode}"', "sampler.num_steps=2",
                             'train.timesteps="all"', "sampler.base_tail=0", "train.kl_beta=0.0",
                             "train.lr=1e-4"])
    model = build_model(cfg.model, seed=0, device=device,
                        tiny_overrides={"num_layers": args.layers, "num_attention_heads": args.heads,
                                        "caption_projection_dim": 16 * args.heads})
    return Policy(model, cfg.train, cfg.sampler, offload=mode), cfg


def _batch(policy: Any, cfg: Any) -> tuple[Any, ...]:
    from digenrl.rl.grpo import group_advantages
    from digenrl.rl.sampler import rollout, seeded_generators

    cond = policy.model.encode_prompts(["a red circle", "a red circle"])
    with torch.no_grad():
        records = {r.index: r for r in rollout(policy.model, cond, generator=seeded_generators([1, 2]),
                                               sampler_cfg=cfg.sampler)}
    adv, stats = group_advantages(torch.tensor([0.2, 0.9]), [0, 0])
    return records, cond, adv, stats.keep


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(policy: Any, batch: tuple[Any, ...], device: torch.device) -> tuple[float, float]:
    """(seconds of the training pass, seconds of the optimizer step)."""
    records, cond, adv, keep = batch
    _sync(device)
    t0 = time.perf_counter()
    policy.fragment_loss_backward(records, cond, adv, keep, batch_size_total=2, n_trained_total=len(records))
    _sync(device)
    t1 = time.perf_counter()
    policy.optimizer_step()
    _sync(device)
    return t1 - t0, time.perf_counter() - t1


def _counted(policy: Any) -> dict[str, int]:
    """CPU: what the mode keeps on the device, counted (params, gradients, masters, AdamW)."""
    grads = _bytes(p.grad for p in policy.params if p.grad is not None)
    device = _bytes(policy.model_params) + grads
    if policy.host is None:
        if policy.params is not policy.model_params:
            device += _bytes(policy.params)
        device += _bytes(v for s in policy.optimizer.state.values() for v in s.values()
                         if isinstance(v, torch.Tensor) and v.dim() > 0)
    host = 0 if policy.host is None else (_bytes(policy.masters) * 2 + _bytes(
        v for s in policy.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0))
    return {"device_bytes_with_grads": device, "host_bytes": host}


def _memory(mode: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Build the mode's policy alone, one warm step, then its memory with the gradients held."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
    policy, cfg = _policy(mode, args, device)
    batch = _batch(policy, cfg)
    _step(policy, batch, device)  # AdamW's state exists from the first step on
    records, cond, adv, keep = batch
    out: dict[str, Any] = {"trained_params": sum(p.numel() for p in policy.model_params)}
    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
    policy.fragment_loss_backward(records, cond, adv, keep, batch_size_total=2, n_trained_total=len(records))
    if device.type == "cuda":
        _sync(device)
        out["device_bytes_with_grads"] = torch.cuda.memory_allocated(device) - base
        policy.optimizer_step()
        _sync(device)
        out["device_peak_bytes"] = torch.cuda.max_memory_allocated(device) - base
        out["measured"] = True
    else:
        out.update(_counted(policy), measured=False)
        policy.optimizer_step()
    del policy, batch
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from digenrl.devices import resolve_device

    torch.set_num_threads(args.threads)
    device = torch.device("cpu") if args.cpu else resolve_device()
    memory = {m: _memory(m, args, device) for m in MODES}
    policies = {m: _policy(m, args, device) for m in MODES}
    batch = _batch(*policies["none"])
    times: dict[str, dict[str, list[float]]] = {m: {"pass_s": [], "step_s": []} for m in MODES}
    for _ in range(args.repeats):
        for m in MODES:
            pass_s, step_s = _step(policies[m][0], batch, device)
            times[m]["pass_s"].append(pass_s)
            times[m]["step_s"].append(step_s)
    a, b = (policies[m][0].state_dict_for_sync() for m in MODES)
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    med = {m: {k: statistics.median(v) for k, v in t.items()} for m, t in times.items()}
    per_param = {m: memory[m]["device_bytes_with_grads"] / memory[m]["trained_params"] for m in MODES}
    return {"device": str(device), "dtype": args.dtype, "layers": args.layers, "heads": args.heads,
            "repeats": args.repeats, "memory": memory, "device_bytes_per_param": per_param,
            "device_bytes_ratio": per_param["optimizer"] / per_param["none"],
            "median_s": med, "step_s_ratio": med["optimizer"]["step_s"] / med["none"]["step_s"],
            "pass_s_ratio": med["optimizer"]["pass_s"] / med["none"]["pass_s"],
            "weights_max_abs_diff": diff}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cpu", action="store_true", help="on the CPU even where a GPU is visible")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON object")
    args = ap.parse_args(argv)
    out = run(args)
    if args.json:
        print(json.dumps(out))
        return
    print(f"{out['device']}, {out['dtype']}, {out['memory']['none']['trained_params']} trained parameters, "
          f"median of {out['repeats']}")
    print(f"{'':<28}{'none':>12}{'optimizer':>12}{'ratio':>8}")
    print(f"{'device B / param (grads)':<28}{out['device_bytes_per_param']['none']:>12.2f}"
          f"{out['device_bytes_per_param']['optimizer']:>12.2f}{out['device_bytes_ratio']:>8.2f}")
    for k in ("pass_s", "step_s"):
        n, o = out["median_s"]["none"][k], out["median_s"]["optimizer"][k]
        print(f"{k:<28}{n:>12.5f}{o:>12.5f}{o / n:>8.2f}")
    print(f"weights after the repeats: max |diff| = {out['weights_max_abs_diff']:.3g}")


if __name__ == "__main__":
    main()
