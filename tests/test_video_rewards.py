"""Video rewards: terms that take the frames (B, T, H, W, 3), image terms per frame with the
mean or the minimum, the temporal-consistency term, on the tiny Wan and HunyuanVideo pipeline
folders' real decodes, and through a reward worker."""

from __future__ import annotations

import json

import pytest
import torch

from digenrl.actors.reward import RewardActor
from digenrl.config import ModelConfig, RewardTerm, load_config
from digenrl.models import build_model
from digenrl.models.pixels import tile_frames
from digenrl.rl.rewards import RewardError, build_reward, check_reward, untile_frames
from digenrl.rl.rewards.stats import brightness
from digenrl.rl.rewards.video import temporal_consistency, video_frames
from digenrl.telemetry.trace import SpanRecorder
from digenrl.transport.protocol import Score
from tests.pipelines import MAX_TEXT_TOKENS, SMALL, write_pipeline_folder

PROMPTS = ["a red circle", "a blue square"]


@pytest.fixture(scope="module")
def videos(tmp_path_factory) -> dict[str, tuple[ModelConfig, torch.Tensor]]:
    """Each video family's tiny folder: its model config and two decoded samples (uint8
    (2, 3, H, T*W), the frames side by side as the rollout hands them to rewards)."""
    root = tmp_path_factory.mktemp("video-folders")
    out = {}
    for family in ("wan", "hunyuanvideo"):
        cfg = ModelConfig(family=family, path=str(write_pipeline_folder(family, root / family)),
                          max_text_tokens=MAX_TEXT_TOKENS, text_encoder="hash", **SMALL)
        model = build_model(cfg)
        x = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            out[family] = (cfg, model.decode(x))
    return out


@pytest.mark.parametrize("family", ["wan", "hunyuanvideo"])
def test_a_frames_term_gets_each_samples_frames_of_the_folders_decode(family, videos):
    cfg, images = videos[family]
    t, h, w = SMALL["num_frames"], SMALL["height"], SMALL["width"]
    assert video_frames(cfg) == t and images.shape == (2, 3, h, t * w)
    reward = build_reward([RewardTerm(name="reward_plugins:ClipDynamics", key="overall")], frames=t)
    scorer = reward.terms[0].scorer
    total, parts = reward(images, PROMPTS)
    assert scorer.seen == [(2, t, h, w, 3)]
    frames = untile_frames(images, t)
    for k in range(t):  # frame k is the k-th w-pixel slice of the decode, channels last
        assert torch.equal(frames[:, k], images[:, :, :, k * w:(k + 1) * w].permute(0, 2, 3, 1))
    assert not torch.equal(frames[:, 0], frames[:, -1])  # a video that moves: the VAE's frames
    assert torch.equal(tile_frames(frames.permute(0, 1, 4, 2, 3)), images)
    expected = scorer(frames, PROMPTS)["overall"]
    assert torch.allclose(total, expected) and torch.equal(parts["reward_plugins:ClipDynamics"], total)
    every = reward.evaluate(images, PROMPTS)  # held-out evaluation sees every value, per video
    assert set(every) == {f"reward_plugins:ClipDynamics/{v}" for v in ("visual", "motion", "overall")}


@pytest.mark.parametrize("family", ["wan", "hunyuanvideo"])
def test_an_image_term_per_frame_takes_the_mean_or_the_minimum_over_the_frames(family, videos):
    cfg, images = videos[family]
    t = video_frames(cfg)
    frames = untile_frames(images, t)
    each = torch.stack([brightness(frames[:, k].permute(0, 3, 1, 2), PROMPTS) for k in range(t)], dim=1)
    reward = build_reward([RewardTerm(name="brightness", label="mean", per_frame="mean"),
                           RewardTerm(name="brightness", label="min", per_frame="min", weight=0.0),
                           RewardTerm(name="brightness", label="whole", weight=0.0)], frames=t)
    _, parts = reward(images, PROMPTS)
    assert torch.allclose(parts["mean"], each.mean(dim=1)) and torch.equal(parts["min"], each.amin(dim=1))
    assert (parts["min"] < parts["mean"]).all()  # the frames differ in brightness
    assert torch.allclose(parts["whole"], parts["mean"])  # equal-sized frames: the mean of means
    # each frame is scored with its own sample's prompt and metadata
    seen: list[str] = []

    def record(images: torch.Tensor, prompts, metadata) -> torch.Tensor:
        seen.extend(f"{p}|{m['n']}|{tuple(images.shape[1:])}" for p, m in zip(prompts, metadata, strict=True))
        return torch.zeros(images.shape[0])

    from digenrl.rl.rewards.base import Reward, Term
    Reward([Term(label="r", weight=1.0, scorer=record, takes_metadata=True, per_frame="mean")], frames=t)(
        images, PROMPTS, [{"n": 0}, {"n": 1}])
    shape = (3, SMALL["height"], SMALL["width"])
    assert seen == [f"{p}|{i}|{shape}" for i, p in enumerate(PROMPTS) for _ in range(t)]


def test_temporal_consistency_is_one_for_a_still_video_and_falls_with_change():
    still = torch.full((1, 4, 64, 64, 3), 90, dtype=torch.uint8)
    flicker = torch.zeros(1, 4, 64, 64, 3, dtype=torch.uint8)
    flicker[:, 1::2] = 255  # black, white, black, white
    half = torch.zeros(1, 2, 64, 64, 3, dtype=torch.uint8)
    half[:, 1, :32] = 255  # the top half turns white
    one = torch.randint(0, 256, (1, 1, 8, 8, 3), dtype=torch.uint8)
    scores = temporal_consistency(torch.cat([still, flicker]), ["a", "b"])
    assert scores.tolist() == [1.0, 0.0]
    assert temporal_consistency(half, ["c"]).item() == pytest.approx(0.5)
    assert temporal_consistency(one, ["d"]).item() == 1.0
    # pixel noise counts for little next to a change of content (frames averaged to 32 px)
    noisy = still.clone()
    noisy[:, 1] = (noisy[:, 1].int() + torch.randint(-40, 41, noisy[:, 1].shape,
                                                     generator=torch.Generator().manual_seed(0))).clamp(0, 255).to(torch.uint8)
    assert temporal_consistency(noisy, ["e"]).item() > 0.95
    with pytest.raises(ValueError, match="size = 0"):
        temporal_consistency(still, ["a"], size=0)


def test_temporal_consistency_as_a_term_scores_the_folders_videos(videos):
    cfg, images = videos["wan"]
    t = video_frames(cfg)
    reward = build_reward([RewardTerm(name="temporal_consistency")], frames=t)
    total, _ = reward(images, PROMPTS)
    assert torch.equal(total, temporal_consistency(untile_frames(images, t), PROMPTS))
    assert ((total > 0) & (total < 1)).all()


def test_video_frames_follow_the_config_and_the_family():
    assert video_frames(ModelConfig(family="wan", path="random")) == 2  # the tiny default
    assert video_frames(ModelConfig(family="hunyuanvideo", path="random", num_frames=5)) == 5
    assert video_frames(ModelConfig(family="sd3", path="random")) == 1
    assert video_frames(ModelConfig(family="wan", path="emulated")) == 1  # decodes frame 0 only


def test_per_frame_on_a_frames_term_and_frames_that_do_not_divide_are_errors():
    term = RewardTerm(name="temporal_consistency", per_frame="min")
    msg = r"reward 'temporal_consistency': per_frame = 'min' is for image terms; this one takes the frames itself"
    with pytest.raises(RewardError, match=msg):
        build_reward([term], frames=2)
    with pytest.raises(RewardError, match=msg):
        check_reward([term])
    reward = build_reward([RewardTerm(name="temporal_consistency")], frames=3)
    with pytest.raises(RewardError, match="width 8 px is not 3 frames side by side"):
        reward(torch.zeros(1, 3, 8, 8, dtype=torch.uint8), ["a"])
    with pytest.raises(Exception, match=r"reward.terms\[0\].per_frame = 'max': expected one of"):
        load_config(None, ['reward.terms=[{ name = "brightness", per_frame = "max" }]'])


@pytest.mark.asyncio
async def test_a_reward_worker_scores_videos_as_the_run_builds_its_reward(videos):
    """The worker's reward is built as digenrl-node builds it (the model config's frames): the
    tiled samples a rollout sends are scored per video, per frame, as one reward call would."""
    cfg, images = videos["hunyuanvideo"]
    run = load_config(None, ['reward.terms=[{ name = "temporal_consistency" }, '
                             '{ name = "brightness", per_frame = "min", weight = 2.0 }]'])
    terms = run.reward.terms
    reward = build_reward(terms, frames=video_frames(cfg))

    class Router:
        def __init__(self) -> None:
            self.sent: list = []

        async def send(self, msg, to):
            self.sent.append((to, msg))

    class Log:
        def __getattr__(self, name):
            return lambda *a, **k: None

    router = Router()
    actor = RewardActor(peers=None, cfg=run, router=router, reward_fn=reward, node_id="reward-0",  # type: ignore[arg-type]
                        recorder=SpanRecorder("reward-0", "reward"), log=Log())
    meta = [json.dumps({"prompt": p}) for p in PROMPTS]
    await actor._score([(b"r0", Score(task_id=1, step=0, images=images[:1], prompts=PROMPTS[:1], metadata=meta[:1])),
                        (b"r1", Score(task_id=2, step=0, images=images[1:], prompts=PROMPTS[1:], metadata=meta[1:]))])
    total, parts = build_reward(terms, frames=SMALL["num_frames"])(images, PROMPTS)
    assert [m.error for _, m in router.sent] == ["", ""]
    assert [r for _, m in router.sent for r in m.rewards] == total.tolist()
    assert router.sent[1][1].reward_terms["brightness"] == parts["brightness"][1:].tolist()
    frames = untile_frames(images, SMALL["num_frames"])
    assert parts["brightness"].tolist() == [min(brightness(frames[i:i + 1, k].permute(0, 3, 1, 2), ["x"]).item()
                                                for k in range(SMALL["num_frames"])) for i in range(2)]
