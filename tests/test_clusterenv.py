"""``digenrl-node --from-env`` (digenrl/clusterenv.py) and the cluster launchers under ops/.

The launcher variables are parsed as Slurm, torchrun and Kubernetes set them; the shipped
sbatch script and Kubernetes manifest are read as files and every task / pod they describe
is planned (``--dry-run``) under a faked environment: one coordinator, every rank once, the
right roles, every node dialling the coordinator's address.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from digenrl.cli import build_node_parser, node_main
from digenrl.clusterenv import ClusterEnv, EnvError, expand_hostlist, plan, read_env
from digenrl.config import load_config

ROOT = Path(__file__).resolve().parent.parent


def test_a_slurm_host_list_expands_ranges_keeping_their_zero_padding() -> None:
    assert expand_hostlist("gpu[01-03,07],login1") == ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]
    assert expand_hostlist("node7") == ["node7"]
    with pytest.raises(EnvError, match="range 'a-3'"):
        expand_hostlist("gpu[a-3]")


def test_each_launcher_gives_rank_world_and_the_coordinator_host() -> None:
    slurm = read_env({"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1", "SLURM_NODEID": "4",
                      "SLURM_JOB_NUM_NODES": "8", "SLURM_STEP_TASKS_PER_NODE": "2(x8)",
                      "SLURM_STEP_NODELIST": "gpu[03-10]"})
    assert slurm == ClusterEnv("slurm", 9, 16, 1, 2, 4, "gpu03")
    torchrun = read_env({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                         "GROUP_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"})
    assert torchrun == ClusterEnv("torchrun", 5, 8, 1, 4, 1, "10.0.0.1")
    job = read_env({"JOB_COMPLETION_INDEX": "3", "DIGENRL_WORLD_SIZE": "16",
                    "DIGENRL_COORDINATOR": "tcp://digenrl-coordinator:5555"})
    assert (job.source, job.rank, job.world, job.coordinator) == ("kubernetes", 3, 16,
                                                                  "tcp://digenrl-coordinator:5555")
    pod = read_env({"KUBERNETES_SERVICE_HOST": "10.96.0.1", "DIGENRL_WORLD_SIZE": "16",
                    "DIGENRL_COORDINATOR": "tcp://c:5555"}, hostname="digenrl-rollout-11")
    assert pod.rank == 11
    # an explicit DIGENRL_RANK overrides the launcher's
    assert read_env({"RANK": "5", "WORLD_SIZE": "8", "MASTER_ADDR": "h", "DIGENRL_RANK": "2"}).rank == 2


@pytest.mark.parametrize(("env", "message"), [
    ({}, "no launcher variables"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, "SLURM_STEP_NODELIST"),
    ({"SLURM_PROCID": "x", "SLURM_NTASKS": "2", "SLURM_NODELIST": "a"}, "SLURM_PROCID = 'x'"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR"),
    ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, "rank 2 is not below the world size 2"),
    ({"JOB_COMPLETION_INDEX": "0"}, "DIGENRL_COORDINATOR"),
])
def test_a_missing_or_bad_launcher_variable_is_refused_naming_it(env: dict[str, str], message: str) -> None:
    with pytest.raises(EnvError, match=re.escape(message)):
        read_env(env, hostname="login")


def test_from_env_errors_are_one_line_and_exit_2(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("os.environ", {"RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "h"})
    assert node_main(["--from-env", "--trainers", "5", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--trainers 5: expected 1..4" in err


def test_one_task_per_host_starts_a_node_per_gpu_with_its_own_device() -> None:
    ce = ClusterEnv("torchrun", 1, 2, 0, 1, 1, "10.0.0.1")  # the second of two hosts, 4 GPUs each
    launches = plan(ce, trainers=2, port=5555, bind_host="10.0.0.2", gpus_per_node=4, gpu="H100")
    assert [(x.role, x.rank, dict(x.env)["CUDA_VISIBLE_DEVICES"]) for x in launches] == [
        ("rollout", 4, "0"), ("rollout", 5, "1"), ("rollout", 6, "2"), ("rollout", 7, "3")]
    # a launcher that shares every GPU with every task: the task takes its local rank's entry
    one = plan(ClusterEnv("slurm", 3, 4, 1, 2, 1, "a"), trainers=1, port=1, bind_host="b", gpu="H100",
               visible="4,5")
    assert dict(one[0].env) == {"CUDA_VISIBLE_DEVICES": "5"}


def _dry_run(argv: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch,
             capsys: pytest.CaptureFixture[str]) -> list[dict]:
    monkeypatch.setattr("os.environ", env)
    assert node_main([*argv, "--dry-run"]) == 0, capsys.readouterr().err
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def _sbatch() -> tuple[dict[str, str], dict[str, str], list[str]]:
    """ops/slurm/digenrl.sbatch: its #SBATCH options, its variables' defaults, and the srun
    line's digenrl-node arguments with those defaults substituted."""
    text = (ROOT / "ops" / "slurm" / "digenrl.sbatch").read_text()
    opts = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", text, re.M))
    defaults = dict(re.findall(r"^(\w+)=\$\{\1:-([^}]*)\}", text, re.M))
    line = re.search(r"^srun .*?(?<!\\)$", text.replace("\\\n", " "), re.M)
    assert line is not None, "no srun line"
    words = shlex.split(line.group(0))
    words = [re.sub(r"\$(\w+)", lambda m: defaults.get(m.group(1), m.group(0)), w) for w in words]
    return opts, defaults, words[words.index("digenrl-node") + 1:]


def test_the_sbatch_script_starts_one_coordinator_and_every_rank_once(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    opts, defaults, argv = _sbatch()
    nodes, per_node = int(opts["nodes"]), int(opts["ntasks-per-node"])
    world, trainers = nodes * per_node, int(defaults["TRAINERS"])
    launches = []
    for task in range(world):
        env = {"SLURM_PROCID": str(task), "SLURM_NTASKS": str(world), "SLURM_LOCALID": str(task % per_node),
               "SLURM_NODEID": str(task // per_node), "SLURM_JOB_NUM_NODES": str(nodes),
               "SLURM_STEP_NODELIST": f"gpu[01-{nodes:02d}]", "SLURM_STEP_TASKS_PER_NODE": f"{per_node}(x{nodes})",
               "CUDA_VISIBLE_DEVICES": "0",  # --gpus-per-task=1: Slurm binds each task to its GPU
               "DIGENRL_BIND_HOST": f"10.0.0.{task // per_node + 1}"}
        launches += [(task, x) for x in _dry_run(argv, env, monkeypatch, capsys)]
    coordinators = [(task, x) for task, x in launches if x["role"] == "coordinator"]
    assert len(coordinators) == 1 and coordinators[0][0] == 0
    c = build_node_parser().parse_args(coordinators[0][1]["argv"])
    port = defaults["PORT"]
    assert c.bind == f"tcp://10.0.0.1:{port}"  # task 0 runs on the first host of the list
    cfg = load_config(c.config, c.overrides)  # the coordinator expects exactly these ranks
    assert (cfg.cluster.trainers, cfg.cluster.rollouts) == (trainers, world - trainers)
    assert cfg.cluster.host == "10.0.0.1"  # its PUB socket and the trainers' rendezvous: reachable
    nodes_ = [x for _, x in launches if x["role"] != "coordinator"]
    assert sorted(x["rank"] for x in nodes_) == list(range(world))
    # trainer ranks on several hosts meet through a file in the (shared) run folder
    trainer_hosts = {task // per_node for task, x in launches if x["role"] == "trainer"}
    assert len(trainer_hosts) == 1 or cfg.cluster.rendezvous == "file"
    for x in nodes_:
        a = build_node_parser().parse_args(x["argv"])
        assert a.role == ("trainer" if x["rank"] < trainers else "rollout")
        assert a.coordinator == f"tcp://gpu01:{port}" and a.gpu == defaults["GPU"]
        assert a.node_id == f"{a.role}-{x['rank']}" and x["env"] == {"CUDA_VISIBLE_DEVICES": "0"}
        assert a.bind.startswith("tcp://10.0.0.") and a.run_dir == c.run_dir and a.config == c.config


def _manifest() -> list[dict]:
    return [d for d in yaml.safe_load_all((ROOT / "ops" / "kubernetes" / "digenrl.yaml").read_text()) if d]


@pytest.mark.parametrize("k8s", ["1.30.0", "1.37.0"])
def test_the_kubernetes_manifest_validates_against_the_kubernetes_schema(k8s: str) -> None:
    """Every document against Kubernetes' own JSON schema (strict: an unknown or misspelt field
    fails too), bundled by kubernetes-validate, so offline; an old and the newest release."""
    import kubernetes_validate

    for d in _manifest():
        assert kubernetes_validate.validate(d, k8s, strict=True) == k8s[:-2]
    bad = _manifest()[1]
    bad["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy"] = 3  # the check can fail
    with pytest.raises(kubernetes_validate.ValidationError, match="imagePullPolicy"):
        kubernetes_validate.validate(bad, k8s, strict=True)


def test_the_kubernetes_manifest_is_well_formed() -> None:
    """What the schema does not say: kinds and API groups, names, selectors that match their
    pod templates, every container command a valid digenrl-node, time for a drain."""
    kinds = {("v1", "Service"), ("apps/v1", "StatefulSet")}
    docs = _manifest()
    assert {(d["apiVersion"], d["kind"]) for d in docs} == kinds
    for d in docs:
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", d["metadata"]["name"])
        if d["kind"] == "Service":
            continue
        pod = d["spec"]["template"]
        if "selector" in d["spec"]:
            assert d["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        for c in pod["spec"]["containers"]:
            assert c["image"] and c["command"][:2] == ["digenrl-node", "--from-env"]
            build_node_parser().parse_args(c["command"][1:])
            mounts = {m["name"] for m in c.get("volumeMounts", [])}
            assert mounts <= {v["name"] for v in pod["spec"].get("volumes", [])}
        assert d["spec"]["serviceName"] and d["spec"]["replicas"] >= 1
        # a SIGTERM drain gets as long as under systemd (TimeoutStopSec, test_ops.py), not 30 s
        assert pod["spec"].get("terminationGracePeriodSeconds", 30) >= 120, d["metadata"]["name"]


def test_the_kubernetes_pods_find_the_coordinator_and_the_counts_agree(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    docs = _manifest()
    service = next(d for d in docs if d["kind"] == "Service")
    sets = {d["metadata"]["labels"]["role"]: d for d in docs if d["kind"] == "StatefulSet"}
    assert service["spec"]["selector"].items() <= sets["trainer"]["spec"]["template"]["metadata"]["labels"].items()
    out: dict[str, list[dict]] = {}
    for role, d in sets.items():
        c = d["spec"]["template"]["spec"]["containers"][0]
        gpus = c["resources"]["limits"]["nvidia.com/gpu"]
        for i in range(d["spec"]["replicas"]):
            env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
            env.update({"KUBERNETES_SERVICE_HOST": "10.96.0.1", "POD_IP": f"10.1.{len(out)}.{i}"})
            monkeypatch.setattr("socket.gethostname", lambda n=f"{d['metadata']['name']}-{i}": n)
            launches = _dry_run(c["command"][1:], env, monkeypatch, capsys)
            assert sum(x["role"] != "coordinator" for x in launches) == gpus  # a node per GPU
            out.setdefault(role, []).extend(launches)
    (coord,) = [x for x in out["trainer"] if x["role"] == "coordinator"]
    a = build_node_parser().parse_args(coord["argv"])
    port = service["spec"]["ports"][0]["targetPort"]
    assert a.bind == f"tcp://10.1.0.0:{port}"  # the trainer pod's POD_IP, the Service's target port
    cfg = load_config(None, a.overrides)
    assert cfg.cluster.host == "10.1.0.0"  # its PUB socket binds the pod's address, not loopback
    trainers = [x for x in out["trainer"] if x["role"] == "trainer"]
    assert (cfg.cluster.trainers, cfg.cluster.rollouts) == (len(trainers), len(out["rollout"]))
    endpoint = f"tcp://{service['metadata']['name']}:{service['spec']['ports'][0]['port']}"
    for role, nodes in (("trainer", trainers), ("rollout", out["rollout"])):
        assert sorted(x["rank"] for x in nodes) == list(range(len(nodes)))
        for x in nodes:
            n = build_node_parser().parse_args(x["argv"])
            assert (n.role, n.coordinator) == (role, endpoint) and n.bind.startswith("tcp://10.1.")
    assert sorted(x["env"]["CUDA_VISIBLE_DEVICES"] for x in trainers) == [str(g) for g in range(len(trainers))]


def test_a_file_rendezvous_is_a_fresh_file_in_the_run_folder_for_every_group(tmp_path: Path) -> None:
    from digenrl.transport.endpoints import rendezvous_endpoint

    shared = load_config(None, ['cluster.rendezvous="file"'])
    first, again = rendezvous_endpoint(shared, tmp_path), rendezvous_endpoint(shared, tmp_path)
    assert first != again  # a restarted group never meets in the old store
    assert first.startswith(f"file://{tmp_path.resolve() / 'dist'}/") and (tmp_path / "dist").is_dir()
    assert rendezvous_endpoint(load_config(None, []), tmp_path).startswith("tcp://127.0.0.1:")


@pytest.mark.slow
def test_one_ctrl_c_drains_every_process_a_from_env_task_started(tmp_path: Path) -> None:
    """A terminal sends SIGINT to its whole foreground process group: the task's coordinator and
    nodes must each hear it once (forwarded), drain and leave, not take it as a second Ctrl-C."""
    from digenrl.actors.cluster import COORDINATOR_STOPPED
    from digenrl.rl.checkpoint import latest_checkpoint
    from digenrl.transport.endpoints import free_port
    from tests.conftest import SMALL, node_final, processes_of, set_args, wait_until

    port, run_dir = free_port(), tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", DIGENRL_RANK="0", DIGENRL_WORLD_SIZE="1",
               DIGENRL_COORDINATOR=f"tcp://127.0.0.1:{port}", DIGENRL_BIND_HOST="127.0.0.1")
    proc = subprocess.Popen([sys.executable, "-m", "digenrl.cli", "node", "--from-env", "--trainers", "1",
                             "--gpus-per-node", "2", "--coordinator-port", str(port), "--run-dir", str(run_dir),
                             *set_args([*SMALL, "run.steps=60", "run.checkpoint_every=1"])],
                            env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        wait_until(lambda: latest_checkpoint(run_dir) is not None, "the first checkpoint", 120)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert "Traceback" not in err, err[-3000:]
    # drained on its own Ctrl-C (exit 0), or first told by the coordinator (exit 1); never the
    # second Ctrl-C's hard exit (130, which writes no node_final at all: node_final fails then)
    finals = {n: node_final(run_dir / "logs" / f"{n}.log") for n in ("trainer-0", "rollout-1")}
    finals = {n: (rec["exit_code"], rec["stop_reason"]) for n, rec in finals.items()}
    for code, reason in finals.values():
        assert (code, reason) in ((0, "SIGINT"), (1, f"{COORDINATOR_STOPPED} (SIGINT)")), finals
    assert proc.returncode == max(code for code, _ in finals.values())
    assert json.loads((run_dir / "summary.json").read_text())["stop_reason"] == f"{COORDINATOR_STOPPED} (SIGINT)"
    assert processes_of(run_dir) == []
