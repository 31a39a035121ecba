"""Each role alone, on recorded data: the pipeline's floor, and a way to debug one side.

``digenrl launch --rollout-only [--record]`` generates the steps' fragments with the
version-0 policy and no trainer (optionally saving them to ``RUN_DIR/recording.pt``);
``digenrl launch --trainer-only RECORDING`` trains from such a recording with no rollout.
Both use the same code as the runtime (FragmentJob, Learner), minus the sockets, and
report seconds per step, so ``max(rollout-only, trainer-only)`` is the step time a
perfect pipeline would reach.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from digenrl.config import Config, ResolvedConfig
from digenrl.core.plan import fragment_content, plan_for_step
from digenrl.data.prompts import load_splits
from digenrl.devices import resolve_device
from digenrl.models.text import free_text_encoders
from digenrl.rl.algorithm import algorithm_for
from digenrl.rl.fragment import FragmentJob
from digenrl.rl.learner import Learner
from digenrl.rl.policy import build_policy
from digenrl.rl.rewards import build_reward
from digenrl.rl.rewards.video import video_frames
from digenrl.rl.sde import sigma_schedule


def _fragments(cfg: Config, step: int, prompt_count: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The step's fragments exactly as the scheduler cuts them."""
    t = cfg.train
    return [fragment_content(cfg.run.seed, step, f, prompts_per_step=t.prompts_per_step,
                             fragments_per_step=cfg.runtime.fragments_per_step,
                             group_size=t.group_size, prompt_count=prompt_count)
            for f in range(cfg.runtime.fragments_per_step)]


def rollout_only(cfg: ResolvedConfig, steps: int, record: Path | None = None) -> dict[str, Any]:
    """Generate ``steps`` steps (all fragments) with the initial policy; wall and CPU
    seconds per step (``step_seconds``, ``cpu_seconds``)."""
    torch.set_num_threads(cfg.run.threads)
    policy = build_policy(cfg, device=resolve_device())
    free_text_encoders(policy.model, cfg)  # model.free_text_encoders, as a rollout node does
    reward_fn = build_reward(cfg.reward.terms, frames=video_frames(cfg.model))
    algorithm = algorithm_for(cfg.train)
    prompts = load_splits(cfg.prompts)[0].prompts
    recording: list[dict[str, Any]] = []
    times, cpu = [], []
    for step in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        trained, sde = plan_for_step(cfg, step)
        for ids, seeds in _fragments(cfg, step, len(prompts)):
            job = FragmentJob(model=policy.model, cfg=cfg, prompts=[prompts[i] for i in ids],
                              seeds=seeds, sde_steps=sde, trained_steps=algorithm.streamed_steps(trained),
                              reward_fn=reward_fn)
            records, result = job.run_all()
            if record is not None:
                inputs = algorithm.local(records, result, trained, list(seeds))
                recording.append({"step": step, "records": inputs.records, "cond": result.cond,
                                  "rewards": result.rewards, "reward_terms": result.reward_terms,
                                  "n_trained": len(trained),
                                  "seeds": list(seeds), "final": inputs.final})
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    if record is not None:
        torch.save(recording, record)
    return {"step_seconds": times, "cpu_seconds": cpu, "samples_per_s": cfg.batch_size * steps / sum(times)}


def trainer_only(cfg: ResolvedConfig, recording: Path) -> dict[str, Any]:
    """Train on a recording (one optimizer step per recorded step); seconds per step."""
    torch.set_num_threads(cfg.run.threads)
    data = torch.load(recording, weights_only=False)
    policy = build_policy(cfg, device=resolve_device())
    free_text_encoders(policy.model, cfg)  # model.free_text_encoders, as a trainer node does
    learner = Learner(policy, cfg)
    sigma_max = float(sigma_schedule(cfg.sampler.num_steps, cfg.sampler.shift)[1])
    by_step: dict[int, list[dict[str, Any]]] = {}
    for frag in data:
        by_step.setdefault(frag["step"], []).append(frag)
    times = []
    for step in sorted(by_step):
        t0 = time.perf_counter()
        for frag in by_step[step]:
            learner.train_fragment(records=frag["records"], cond=frag["cond"], rewards=frag["rewards"],
                                   gen_version=policy.version, n_trained_total=frag["n_trained"],
                                   sigma_max=sigma_max, reward_terms=frag.get("reward_terms"),
                                   final=frag.get("final"), seeds=frag.get("seeds"))
        learner.finish_step()
        times.append(time.perf_counter() - t0)
    return {"step_seconds": times, "samples_per_s": cfg.batch_size * len(times) / sum(times)}
