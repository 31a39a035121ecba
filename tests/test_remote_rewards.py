"""Remote rewards against real HTTP servers on loopback: flow_grpo's protocol and a VLM judge."""

import json
import socket

import pytest
import torch
from reward_servers import chat_server, flow_grpo_server, mean_pixel

from digenrl.config import RewardTerm
from digenrl.rl.rewards import RewardError, build_reward
from digenrl.rl.rewards.remote import jpeg_bytes


def images(n: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 256, (n, 3, 16, 16), generator=g, dtype=torch.uint8)


def http_term(url: str, **args) -> RewardTerm:
    return RewardTerm(name="http", label="geneval", args={"url": url, "backoff_s": 0.01, **args})


def test_flow_grpo_server_scores_images_and_gets_their_metadata():
    meta = [{"prompt": f"p{i}", "tag": "single_object", "include": [{"class": "cat", "count": i}]}
            for i in range(3)]
    with flow_grpo_server() as server:
        reward = build_reward([http_term(server.url, batch_size=2)])
        total, parts = reward(images(), ["p0", "p1", "p2"], meta)
    assert [len(r["images"]) for r in server.requests] == [2, 1]  # batched by args.batch_size
    assert [m for r in server.requests for m in r["meta_datas"]] == meta
    assert all(r["only_strict"] is False for r in server.requests)
    expected = [mean_pixel(j) for j in jpeg_bytes(images())]
    # float32 of the server's float64 scores: the client casts, nothing else
    assert total.tolist() == torch.tensor(expected, dtype=torch.float32).tolist()
    assert torch.equal(parts["geneval"], total)


def test_another_answer_key_is_the_reward_when_args_name_it():
    with flow_grpo_server() as server:
        total, _ = build_reward([http_term(server.url, key="strict_rewards")])(images(), ["", "", ""])
        assert total.tolist() == [float(s > 0.6) for s in server.answers[0]]
        with pytest.raises(RewardError, match=r"answer has no 'outputs' .*set args.key"):
            build_reward([http_term(server.url, key="outputs")])(images(), ["", "", ""])


def test_server_errors_are_retried_a_bounded_number_of_times_then_named():
    with flow_grpo_server() as server:
        server.fail_next = [503, 500]
        total, _ = build_reward([http_term(server.url, retries=2)])(images(), ["", "", ""])
        assert len(server.requests) == 1 and total.numel() == 3
        server.fail_next = [503, 503, 503]
        with pytest.raises(RewardError, match=rf"reward server {server.url}: HTTP 503 .*after 3 attempts"):
            build_reward([http_term(server.url, retries=2)])(images(), ["", "", ""])
        server.fail_next = [400]
        with pytest.raises(RewardError, match=r"HTTP 400 .*after 1 attempt,"):
            build_reward([http_term(server.url, retries=5)])(images(), ["", "", ""])


def test_a_redirect_is_refused_so_nothing_is_unpickled_from_another_url():
    with flow_grpo_server() as server:
        server.fail_next = [302]
        with pytest.raises(RewardError, match=r"redirect to http://127.0.0.1:9/elsewhere refused"):
            build_reward([http_term(server.url, retries=0)])(images(), ["", "", ""])


def test_an_answer_that_is_not_a_pickle_is_named_with_the_server():
    with flow_grpo_server() as server:
        server.fail_next = [-1]
        with pytest.raises(RewardError, match=r"answer is not a pickle .*<html>"):
            build_reward([http_term(server.url, retries=0)])(images(), ["", "", ""])


def test_an_unreachable_server_fails_after_its_retries_naming_the_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    url = f"http://127.0.0.1:{port}/score"
    with pytest.raises(RewardError, match=rf"reward server {url}: .*after 2 attempts"):
        build_reward([http_term(url, retries=1, timeout_s=2.0)])(images(), ["", "", ""])


@pytest.mark.parametrize("url", ["ftp://x/", "127.0.0.1:80", "", 5])
def test_a_url_that_is_not_http_is_a_build_error(url):
    with pytest.raises(RewardError, match="expected an http:// or https:// URL"):
        build_reward([RewardTerm(name="http", args={"url": url})])


def test_vlm_judge_asks_per_image_with_the_template_and_parses_the_score(monkeypatch):
    monkeypatch.setenv("JUDGE_TOKEN", "s3cret")
    with chat_server(lambda q: "I would say 7.5 out of 10" if "cow" in q else "3") as server:
        reward = build_reward([RewardTerm(name="vlm_judge", args={
            "url": server.url + "/v1", "model": "qwen-vl", "api_key_env": "JUDGE_TOKEN",
            "template": "Is this {prompt} ({tag})?", "backoff_s": 0.01})])
        total, _ = reward(images(2), ["a cow", "a dog"], [{"prompt": "a cow", "tag": "t1"},
                                                          {"prompt": "a dog", "tag": "t2"}])
    assert total.tolist() == pytest.approx([0.75, 0.3])
    assert {r["path"] for r in server.requests} == {"/v1/chat/completions"}
    assert {r["auth"] for r in server.requests} == {"Bearer s3cret"}
    texts = sorted(c["text"] for r in server.requests for c in r["body"]["messages"][0]["content"]
                   if c["type"] == "text")
    assert texts == ["Is this a cow (t1)?", "Is this a dog (t2)?"]
    assert all(r["body"]["model"] == "qwen-vl" and r["body"]["temperature"] == 0 for r in server.requests)


def test_vlm_answer_without_a_number_is_an_error_not_a_zero():
    with chat_server(lambda q: "I cannot judge this image.") as server:
        reward = build_reward([RewardTerm(name="vlm_judge", args={"url": server.url, "model": "m"})])
        with pytest.raises(RewardError, match=r"answer 'I cannot judge this image.' does not match"):
            reward(images(1), ["x"])
    json.dumps(server.requests[0]["body"])  # the request was plain JSON


@pytest.mark.slow
def test_a_launch_scored_by_a_flow_grpo_server_logs_the_servers_scores(tmp_path):
    from digenrl.config import load_config, resolve_mode
    from digenrl.launch import launch, make_run_dir
    from digenrl.telemetry.metrics import read_metrics
    from tests.conftest import SUITE_SETS

    with flow_grpo_server() as server:
        term = f'reward.terms=[{{ name = "http", label = "geneval", args = {{ url = "{server.url}" }} }}]'
        cfg = resolve_mode(load_config(None, [
            *SUITE_SETS, "run.steps=3", 'model.path="random"', "train.prompts_per_step=2",
            "train.group_size=2", "runtime.fragments_per_step=1", "sampler.num_steps=4",
            'runtime.tag="never"', term]), "digenrl")
        summary = launch(cfg, make_run_dir(cfg, str(tmp_path / "run")))
    rows = read_metrics(tmp_path / "run")
    assert summary["accounting"]["in_flight"] == 0 and [r["step"] for r in rows] == [0, 1, 2]
    # one request per step (one rollout, one fragment a step, no TAG), in step order
    assert [len(a) for a in server.answers] == [4, 4, 4]
    for row, answer in zip(rows, server.answers):
        scores = torch.tensor(answer, dtype=torch.float32).tolist()  # what the client hands on
        assert row["reward/geneval"] == pytest.approx(sum(scores) / 4, rel=1e-12, abs=0)
        assert row["reward_mean"] == pytest.approx(sum(scores) / 4, rel=1e-6)
