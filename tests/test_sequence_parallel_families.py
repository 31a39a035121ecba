"""The sequence-parallel forward of the families' transformers (digenrl.models.seqpar) over
real gloo process groups, on tiny folders saved by the real diffusers pipelines: one GRPO
fragment (KL term on, PPO clip active) and a sampled trajectory (the sampler's steps and
log-probs under the sharded forward) at SP = 2 for every family and SP = 4 for Wan and Z-Image
(4-head folders), against the same with the plain forward in one process.

Each worker launch (tests/sp_family_worker.py) runs a batch of cases in one process group,
so imports and the group are paid once per batch: Wan and FLUX at SP = 2, and Wan with FSDP2
sharding over the same two ranks (about 50 s); FLUX.2 and Z-Image at SP = 2, each also sampled
through a LeaderModel (about 10 s); and, marked slow, SD3, Qwen-Image, HunyuanVideo and a
FLUX.2-dev folder at SP = 2, Z-Image with activation checkpointing at SP = 2, and Wan and
Z-Image at SP = 4.
"""
from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.pipelines import write_pipeline_folder
from tests.sp_family_worker import sizes_of

WORKER = Path(__file__).parent / "sp_family_worker.py"
#: case -> (family, degree, folder builder kwargs (``builder``: tests/pipelines.py's name, if not
#: the family's), the worker launch that runs it)
CASES = {
    "wan": ("wan", 2, {}, "sp2"), "flux": ("flux", 2, {}, "sp2"),
    "wan-fsdp": ("wan", 2, {}, "sp2"),  # FSDP2 over the same two ranks (the key's -fsdp)
    "sd3": ("sd3", 2, {}, "sp2-more"), "qwenimage": ("qwenimage", 2, {}, "sp2-more"),
    "hunyuanvideo": ("hunyuanvideo", 2, {}, "sp2-more"),
    "wan-4heads": ("wan", 4, {"heads": 4}, "sp4"),
    # Z-Image at SP = 4: its caption padding to 32 tokens is split four ways. FLUX.2 at SP = 4
    # adds nothing its SP = 2 case and Wan's SP = 4 do not cover (the all-to-alls are degree-free)
    "zimage-4heads": ("zimage", 4, {"heads": 4}, "sp4"),
    # FLUX.2 (klein; its single-stream blocks' fused projection) and Z-Image (the unified
    # image+caption sequence, captions of two padded lengths: a batch-padding key mask)
    "flux2": ("flux2", 2, {}, "sp2-single-stream"), "zimage": ("zimage", 2, {}, "sp2-single-stream"),
    "flux2-dev": ("flux2", 2, {"builder": "flux2-dev"}, "sp2-more"),  # embedded guidance, Mistral3
    "zimage-ckpt": ("zimage", 2, {}, "sp2-more"),  # activation checkpointing: its block hooks run twice
    # sampling through a LeaderModel: rank 0 drives, the others serve (digenrl.models.spgroup)
    "wan-leader": ("wan", 2, {}, "sp2"), "flux-leader": ("flux", 2, {}, "sp2"),
    "flux2-leader": ("flux2", 2, {}, "sp2-single-stream"), "zimage-leader": ("zimage", 2, {}, "sp2-single-stream"),
}
SLOW = {"sp2-more", "sp4"}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _folder(family: str, folder: Path, kw: dict[str, Any]) -> Path:
    built = {k: v for k, v in kw.items() if k != "builder"}
    return write_pipeline_folder(kw.get("builder", family), folder, **built)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict[str, dict[str, Any]]]:
    """case -> its {"sp": ..., "ref": ...}; a launch runs when one of its cases is first asked for."""
    root = tmp_path_factory.mktemp("sp_families")
    done: dict[str, dict[str, dict[str, Any]]] = {}

    def get(case: str) -> dict[str, dict[str, Any]]:
        launch = CASES[case][3]
        if case not in done:
            todo = {c: v for c, v in CASES.items() if v[3] == launch}
            args = [f"{c}={family}={_folder(family, root / c, kw)}" for c, (family, _, kw, _) in todo.items()]
            path = root / f"{launch}.pt"
            subprocess.run([sys.executable, str(WORKER), str(todo[case][1]), str(_port()), str(path), *args],
                           check=True, timeout=600)
            done.update({c: {**got, "folder": root / c} for c, got in torch.load(path).items()})
        return done[case]
    return get


@pytest.mark.parametrize("case", [pytest.param(c, marks=[pytest.mark.slow] if v[3] in SLOW else [])
                                  for c, v in CASES.items() if not c.endswith("-leader")])
def test_sharded_fragment_matches_the_one_process_forward(runs: Callable, case: str) -> None:
    got, ref = runs(case)["sp"], runs(case)["ref"]
    n = CASES[case][1]
    # each rank carried 1/N of the tokens through the blocks: the sharding really ran (Z-Image:
    # 1/N of its unified image+caption sequence to the final layer, 1/N of its image tokens
    # through the noise refiner)
    assert int(got["tokens"]) * n == int(ref["tokens"])
    assert int(got["image_tokens"]) * n == int(ref["image_tokens"])
    # the launcher's count (which refuses a degree that does not divide it) is the transformer's
    from digenrl.config import ModelConfig
    from digenrl.models.meta import image_tokens, latent_shape_of, transformer_config
    family = CASES[case][0]
    mc = ModelConfig(family=family, path=str(runs(case)["folder"]), **sizes_of(family))
    assert image_tokens(family, transformer_config(mc)[0], latent_shape_of(mc)) == int(ref["image_tokens"])
    assert got.pop("refused") == (f"sequence parallelism: {2 * n + 1} image/video tokens, not "
                                  f"divisible by train.sequence_parallel = {n}")
    assert set(got) == set(ref)
    # float32; the ranks attend over the same tokens per head but sum some terms (the text
    # replicas' gradients, the all-reduce of the parameter gradients) in another order
    for name in ("velocity", "logp0", "logp1", "loss", "kl", "sampled", "sampled_logp"):
        torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)
    assert float(ref["kl"]) > 0  # the reference pass (adapter off) differs from the policy
    grads = [k for k in ref if k.startswith("grad:")]
    assert grads and max(float(ref[k].abs().max()) for k in grads) > 1e-5
    for k in grads:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-4, atol=1e-8, msg=k)


def test_a_degree_that_does_not_divide_the_heads_is_refused() -> None:
    from diffusers import WanTransformer3DModel

    from digenrl.models.seqpar import check_heads, heads_of

    t = WanTransformer3DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
                              text_dim=8, freq_dim=8, ffn_dim=8, num_layers=1)
    with pytest.raises(ValueError, match="has 2 attention heads"):
        check_heads(heads_of(t), 4)
    check_heads(heads_of(t), 2)


@pytest.mark.parametrize(("sets", "mode", "message"), [
    (["run.mode=\"colocated\""], "colocated", r"train\.sequence_parallel = 2 with run\.mode = 'colocated'"),
    (["runtime.tag=\"always\""], "digenrl", r"train\.sequence_parallel = 2 with runtime\.tag = 'always'"),
    (["model.path=\"emulated\""], "digenrl", r"train\.sequence_parallel = 2 with model\.path = 'emulated'"),
])
def test_what_sequence_parallelism_cannot_combine_with_is_refused_in_the_config(sets, mode, message) -> None:
    from digenrl.config import ConfigError
    from tests.factories import tiny_config

    with pytest.raises(ConfigError, match=message):
        tiny_config("train.sequence_parallel=2", *sets, mode=mode)


@pytest.mark.parametrize(("sets", "message"), [
    (["cluster.trainers=3", "train.sequence_parallel=2"],
     r"^cluster\.trainers = 3: train\.sequence_parallel = 2 lays the trainer ranks out in groups "
     r"of 2; expected a multiple of 2$"),
    (["cluster.trainers=1", "train.sequence_parallel=2"], r"^cluster\.trainers = 1: .* expected a multiple of 2$"),
    # the tiny random SD3 has 4 heads
    (["cluster.trainers=3", "train.sequence_parallel=3"],
     r"^train\.sequence_parallel = 3: the transformer has 4 attention heads; expected a divisor of 4$"),
    # 36 x 36 px: the tiny SD3's 18 x 18 latent in 2 x 2 patches, 81 tokens
    (["cluster.trainers=2", "train.sequence_parallel=2", "model.height=36", "model.width=36"],
     r"^train\.sequence_parallel = 2: model\.height x model\.width give 81 image/video tokens per "
     r"sample; expected a multiple of 2 \(there is no padding\)$"),
    (["cluster.trainers=2", "train.sequence_parallel=2", 'model.family="qwenimage_edit"'],
     r"^train\.sequence_parallel = 2 with model\.family = 'qwenimage_edit': no sequence-parallel forward"),
])
def test_the_launcher_refuses_a_degree_the_trainers_or_the_model_cannot_take(tmp_path: Path, sets, message) -> None:
    from digenrl.config import ConfigError
    from digenrl.launch import launch, make_run_dir
    from tests.factories import tiny_config

    cfg = tiny_config(*sets, mode="digenrl")
    run_dir = make_run_dir(cfg, str(tmp_path / "run"))
    with pytest.raises(ConfigError, match=message):
        launch(cfg, run_dir)
    assert not list((run_dir / "logs").glob("*.stderr"))  # no child was ever started


def test_flux2_and_zimage_degrees_are_checked_at_launch_by_their_own_heads_and_token_counts(tmp_path: Path) -> None:
    from digenrl.config import ConfigError
    from digenrl.launch import check_sequence_parallel
    from tests.factories import tiny_config

    # the tiny random FLUX.2 and Z-Image have 2 heads: 2 is taken, 4 is refused naming them
    for family in ("flux2", "zimage"):
        check_sequence_parallel(tiny_config(f'model.family="{family}"', "cluster.trainers=2",
                                            "train.sequence_parallel=2", mode="digenrl"))
        with pytest.raises(ConfigError, match=r"^train\.sequence_parallel = 4: the transformer has 2 attention heads"):
            check_sequence_parallel(tiny_config(f'model.family="{family}"', "cluster.trainers=4",
                                                "train.sequence_parallel=4", mode="digenrl"))
    # Z-Image's heads are its config's n_heads; 6 of them take 3, but its 32-token padding does not
    (tmp_path / "config.json").write_text(json.dumps({"_class_name": "ZImageTransformer2DModel", "n_heads": 6,
                                                      "dim": 96, "in_channels": 4, "all_patch_size": [2]}))
    z6 = ['model.family="zimage"', f'model.path="{tmp_path}"']
    check_sequence_parallel(tiny_config(*z6, "cluster.trainers=2", "train.sequence_parallel=2", mode="digenrl"))
    with pytest.raises(ConfigError, match=r"^train\.sequence_parallel = 3: Z-Image pads its image and caption "
                                          r"sequences to multiples of 32 tokens; expected a divisor of 32$"):
        check_sequence_parallel(tiny_config(*z6, "cluster.trainers=3", "train.sequence_parallel=3", mode="digenrl"))


@pytest.mark.parametrize("case", ["wan-leader", "flux-leader", "flux2-leader", "zimage-leader"])
def test_a_trajectory_sampled_over_a_group_driven_by_its_leader_is_the_one_process_trajectory(
        runs: Callable, case: str) -> None:
    got, ref = runs(case)["sp"], runs(case)["ref"]
    served = got.pop("served").tolist()  # [leader's evaluations, each follower's]
    assert served[0] > 0 and all(s == served[0] for s in served)
    assert set(got) == set(ref)
    # the group's forward attends per head over the same tokens as one process: float32, 1e-5
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)
    # the loaded weights (and, in the base-model tail, the adapter switch) reached the follower:
    # the second trajectory differs from the first as the one-process one does
    assert float((ref["after"] - ref["before"]).abs().max()) > 1e-3


def test_a_rollout_degree_the_model_cannot_take_is_refused_at_launch(tmp_path: Path) -> None:
    from digenrl.config import ConfigError
    from digenrl.launch import launch, make_run_dir
    from tests.factories import tiny_config

    cfg = tiny_config("cluster.rollout_gpus=3", mode="digenrl")  # the tiny SD3 has 4 heads
    run_dir = make_run_dir(cfg, str(tmp_path / "run"))
    with pytest.raises(ConfigError, match=r"^cluster\.rollout_gpus = 3: the transformer has 4 attention heads"):
        launch(cfg, run_dir)
    with pytest.raises(ConfigError, match=r"cluster\.rollout_gpus = 2 with sampler\.compile = true"):
        tiny_config("cluster.rollout_gpus=2", "sampler.compile=true", "sampler.max_batch=8")
