"""Worker of tests/test_sequence_parallel_families.py: one GRPO fragment of a tiny pipeline
folder's model, run by N gloo ranks with the sequence-parallel forward. Rank 0 writes what the test compares: the
velocity at a probe, each trained step's per-sample log-probs, the loss and the LoRA
gradients (summed over the ranks, as a trainer's all-reduce sums them).

Rank 0 then runs the same fragment again on a fresh model in its own process with the
plain forward (the reference). A KEY ending in -ckpt runs both with activation checkpointing
(the blocks' hooks run again in the recompute). A KEY ending in -fsdp also shards the policy with FSDP2 over
the same ranks; one ending in -leader samples through a LeaderModel instead (:func:`mirrored`). Run: python tests/sp_family_worker.py N PORT OUT.pt KEY=FAMILY=FOLDER ...
"""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = {"height": 32, "width": 48, "num_frames": 5}
PROMPTS = ["a red cat on a mat", "two blue dogs"]
#: Z-Image: 12 x 12 patches (144 tokens, padded to 160 by the transformer) and captions of
#: about 28 and 48 tokens (padded to 32 and 64: the unified sequences take a batch-padding mask)
ZIMAGE_SIZES = {"height": 48, "width": 48}
ZIMAGE_PROMPTS = ["a red cat", "two blue dogs running across a wide green field"]


def sizes_of(family: str) -> dict[str, int]:
    """The model config's sizes the worker uses for ``family``."""
    if family == "zimage":
        return dict(ZIMAGE_SIZES)
    video = family in ("wan", "hunyuanvideo")
    return {k: v for k, v in SIZES.items() if k != "num_frames" or video}


def model_config(family: str, folder: str, checkpointing: bool = False) -> Any:
    from digenrl.config import ModelConfig

    return ModelConfig(family=family, path=folder, lora_rank=4, max_text_tokens=48 if family == "zimage" else 24,
                       gradient_checkpointing=checkpointing, **sizes_of(family))


def prompts_of(family: str) -> list[str]:
    return ZIMAGE_PROMPTS if family == "zimage" else PROMPTS


def split_points(transformer: Any) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Where the sequence-parallel forward gathers the velocity tokens, and the first block that
    sees the split image tokens (Z-Image: its final layer and first noise-refiner block)."""
    if hasattr(transformer, "all_final_layer"):
        return next(iter(transformer.all_final_layer.values())), transformer.noise_refiner[0]
    return transformer.proj_out, transformer.proj_out


def run(family: str, folder: str, n: int, rank: int, fsdp: bool = False, checkpointing: bool = False) -> dict[str, Any]:
    from digenrl.config import load_config
    from digenrl.models import build_model
    from digenrl.rl.policy import Policy
    from digenrl.rl.sampler import rollout, seeded_generators
    from digenrl.rl.sde import sde_step

    model = build_model(model_config(family, folder, checkpointing), seed=0)
    cfg = load_config(None, ["sampler.num_steps=2", "sampler.base_tail=0", 'train.timesteps="all"', "train.kl_beta=0.5",
                             "train.clip_range=0.2"])
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # LoRA B starts at zero: move it, so the policy differs from the KL reference
        for name, p in model.transformer.named_parameters():
            if "lora_B" in name:
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    policy = Policy(model, cfg.train, cfg.sampler, shard=fsdp)  # FSDP2 over the same ranks
    cond = model.encode_prompts(prompts_of(family))
    x = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # the rollout: the plain forward on every rank (the same samples)
        records = dict(enumerate(rollout(model, cond, generator=seeded_generators([5, 6]),
                                         sampler_cfg=cfg.sampler)))
    out: dict[str, Any] = {}
    sharded: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if n > 1:
        from digenrl.models.seqpar import enable_sequence_parallel
        sp = enable_sequence_parallel(model, dist.group.WORLD)
        sharded = sp.active()
        try:  # a token count the degree does not divide is refused, naming it
            sp.shard(torch.zeros(1, 2 * n + 1, 1), 1)
        except ValueError as e:
            out["refused"] = str(e)
    # tokens reaching the output projection, and the image tokens reaching the first split
    # block, on this rank: the shard's, under SP (these hooks run after the sharding ones)
    seen: list[int] = []
    image: list[int] = []
    out_proj, first = split_points(model.transformer)
    hooks = [out_proj.register_forward_hook(lambda _m, args, _o: seen.append(args[0].shape[1])),
             first.register_forward_pre_hook(lambda _m, args: image.append(args[0].shape[1]))]
    with sharded:
        with torch.no_grad():
            out["velocity"] = model.velocity(x, 0.6, cond)
            out["tokens"], out["image_tokens"] = torch.tensor(seen[-1]), torch.tensor(image[-1])
            for h in hooks:
                h.remove()
            for t, rec in records.items():
                v = model.velocity(rec.x_t, rec.sigma, cond)
                out[f"logp{t}"] = sde_step(cfg.sampler.sde_type, rec.x_t, v, rec.sigma, rec.sigma_next,
                                           noise_level=cfg.sampler.noise_level, eta=cfg.sampler.eta,
                                           sigma_max=policy.sigma_max, x_next=rec.x_next).log_prob
        # a perturbed behaviour log-prob, so the ratio is not 1 and the clip is exercised
        for rec in records.values():
            rec.log_prob = rec.log_prob + torch.tensor([0.05, -0.3])
        stats = policy.fragment_loss_backward(records, cond, torch.tensor([1.0, -0.5]),
                                              torch.ones(2, dtype=torch.bool), batch_size_total=2,
                                              n_trained_total=len(records))
        with torch.no_grad():  # a whole trajectory sampled with the sharded forward (the rollout's use)
            steps = list(rollout(model, cond, generator=seeded_generators([7, 8]), sampler_cfg=cfg.sampler))
        out["sampled"] = torch.stack([r.x_next for r in steps])
        out["sampled_logp"] = torch.stack([r.log_prob for r in steps])
    out["loss"] = torch.tensor(stats["loss"], dtype=torch.float64)
    out["kl"] = torch.tensor(stats["kl"], dtype=torch.float64)
    for name, p in model.transformer.named_parameters():
        if p.requires_grad:
            g = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
            if fsdp:  # FSDP2 reduce-scattered (summed) the ranks' gradients: gather the shards
                from digenrl.rl.sharding import full
                g = full(g)
            elif n > 1:
                dist.all_reduce(g)  # the group's parts add up to the gradient
            out["grad:" + name] = g
    return out


def mirrored(family: str, folder: str, rank: int) -> dict[str, Any] | None:
    """A sampled trajectory of a :class:`~digenrl.models.spgroup.LeaderModel` over the whole
    world (the other ranks serve), with a base-model tail and new weights loaded between two
    trajectories; rank 0 returns it beside the same with the plain model, in one process."""
    from digenrl.config import load_config
    from digenrl.models import build_model
    from digenrl.models.spgroup import LeaderModel, serve
    from digenrl.rl.sampler import rollout, seeded_generators

    cfg = load_config(None, ["sampler.num_steps=4", "sampler.base_tail=1"])

    def model() -> Any:
        return build_model(model_config(family, folder), seed=0)

    served: list[Any] = [None] * dist.get_world_size()
    if rank != 0:
        dist.all_gather_object(served, serve(model(), dist.group.WORLD))
        return None

    def trajectories(m: Any) -> dict[str, torch.Tensor]:
        cond = m.encode_prompts(prompts_of(family))
        got = {}
        for name in ("before", "after"):
            if name == "after":  # new weights (a moved LoRA), as a rollout applies them
                g = torch.Generator().manual_seed(3)
                m.load_sync_state_dict({k: v + 0.05 * torch.randn(v.shape, generator=g)
                                        for k, v in sorted(m.sync_state_dict().items())})
            steps = list(rollout(m, cond, generator=seeded_generators([7, 8]), sampler_cfg=cfg.sampler,
                                 sde_steps=[0, 1]))
            got[name] = torch.stack([r.x_next for r in steps])
            got[name + "_logp"] = torch.stack([r.log_prob for r in steps])
        return got

    lead = LeaderModel(model(), dist.group.WORLD)
    sharded = trajectories(lead)
    lead.stop()
    dist.all_gather_object(served, lead.evaluations)  # each follower's count of served calls
    sharded["served"] = torch.tensor(served)
    return {"sp": sharded, "ref": trajectories(model())}


def _rank(rank: int, n: int, port: int, path: str, cases: list[tuple[str, str, str]]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=n)
    got = {}
    for key, family, folder in cases:
        if key.endswith("-leader"):
            mirror = mirrored(family, folder, rank)
            if mirror is not None:
                got[key] = mirror
            dist.barrier()
            continue
        ckpt = key.endswith("-ckpt")
        sharded = run(family, folder, n, rank, fsdp=key.endswith("-fsdp"), checkpointing=ckpt)
        if rank == 0:  # the reference: a fresh model, the plain forward, in this one process
            got[key] = {"sp": sharded, "ref": run(family, folder, 1, 0, checkpointing=ckpt)}
        dist.barrier()
    if rank == 0:
        torch.save(got, path)
    dist.barrier()  # no rank tears the group down while another is still in it
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    n_, port_, out_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    # each case: KEY=FAMILY=FOLDER
    todo = [tuple(a.split("=", 2)) for a in sys.argv[4:]]
    mp.spawn(_rank, args=(n_, port_, out_path, todo), nprocs=n_)
