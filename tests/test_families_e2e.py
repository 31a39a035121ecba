"""A pipeline folder trained end to end by ``digenrl launch`` (digenrl mode, real processes),
its ``final/`` loaded into the family's diffusers pipeline.

Each launch is three processes importing torch, diffusers and transformers: tens of seconds
even at tiny sizes. The suite runs one family (Wan: video, frames set); every family's
folder loading, prompt encoding, decoding, saving and diffusers loading is tested at the unit
level in tests/test_model_folders.py. ``DIGENRL_E2E_FAMILIES=sd3,flux,wan,qwenimage,hunyuanvideo,
flux2,flux2-dev,zimage`` runs every family's folders here (``flux2`` is FLUX.2-klein's); ``flux@1024`` is the device check's FLUX at 1024 x 1024 px with the run's default
settings (16 images a step; a tiny FLUX folder whose VAE upsamples 16x, so the transformer sees
a 64 x 64 latent): no node may be lost, the step-0 sample grid is capped in size.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import SUITE_SETS, assert_close_across_instances, assert_same_weights
from tests.pipelines import MAX_TEXT_TOKENS, SMALL, load_pipeline, write_pipeline_folder

pytestmark = pytest.mark.slow

E2E_FAMILIES = os.environ.get("DIGENRL_E2E_FAMILIES", "wan").split(",")
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("case", E2E_FAMILIES)
def test_a_pipeline_folder_trains_end_to_end_and_its_final_loads_into_diffusers(case: str, tmp_path: Path) -> None:
    from PIL import Image
    from safetensors.torch import load_file

    from digenrl.config import ModelConfig
    from digenrl.models import build_model
    from digenrl.models.families import SPECS
    from digenrl.telemetry.images import MAX_SIDE

    folder_case, _, px = case.partition("@")
    family = folder_case.split("-")[0]  # flux2-dev: a FLUX.2 folder of the other pipeline
    video = family in ("wan", "hunyuanvideo")
    if px:  # a large size at the run's default batch and steps (the device check's FLUX at 1024 px)
        folder = write_pipeline_folder(folder_case, tmp_path / family, vae_factor=16)
        sizes = {"height": int(px), "width": int(px)}
        small_run: list[str] = []
    else:
        folder = write_pipeline_folder(folder_case, tmp_path / family)
        sizes = {k: v for k, v in SMALL.items() if k != "num_frames" or video}
        small_run = ["train.prompts_per_step=2", "train.group_size=2", "sampler.num_steps=4"]
    sets = [*SUITE_SETS, f'model.path="{folder}"', f'model.family="{family}"', "model.lora_rank=4",
            f"model.max_text_tokens={MAX_TEXT_TOKENS}", *[f"model.{k}={v}" for k, v in sizes.items()],
            *small_run]
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "digenrl.cli", "launch", "--steps", "3", "--run-dir", str(run_dir),
         *[a for s in sets for a in ("--set", s)]],
        cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    acc = summary["accounting"]
    assert summary["steps"] == 3 and summary["mode"] == "digenrl" and acc["in_flight"] == 0
    assert acc["admitted"] == acc["trained"] + sum(acc["discarded"].values())
    assert summary["recovery"]["trainer_resets"] == 0 and summary["recovery"]["rollouts_lost"] == 0
    assert summary["restarts"] == {}
    grids = sorted((run_dir / "samples").glob("step_0000_*.png"))
    assert grids and all(max(Image.open(g).size) <= MAX_SIDE for g in grids)

    # final/ into the diffusers pipeline: the LoRA in it is the one trained, and its velocity
    trained = load_file(run_dir / "final" / "policy.safetensors")
    pipe = load_pipeline(folder)
    pipe.load_lora_weights(run_dir / "final")
    loaded = {k.replace(".default_0", ""): v for k, v in pipe.transformer.state_dict().items() if "lora_" in k}
    assert_same_weights(loaded, trained)
    ours = build_model(ModelConfig(family=family, path=str(folder), lora_rank=4, max_text_tokens=MAX_TEXT_TOKENS,
                                   **sizes))
    ours.load_sync_state_dict(trained)
    theirs = SPECS[family].adapter(pipe.transformer, encoder=ours.encoder, decoder=ours.decoder,
                                   latent_shape=ours.latent_shape)
    theirs.guidance = ours.guidance
    x = torch.randn(2, *ours.latent_shape, generator=torch.Generator().manual_seed(0))
    cond = ours.encode_prompts(["a red circle", "a blue square"])
    with torch.no_grad():
        assert_close_across_instances(theirs.velocity(x, 0.5, cond), ours.velocity(x, 0.5, cond))
