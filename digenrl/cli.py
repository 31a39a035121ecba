"""Command line: ``digenrl`` (launch, eval, plan, report, keys, config) and ``digenrl-node``.

The event loop (uvloop), logging and torch threads are set up once here, at the entry point,
and passed down; nothing below creates its own loop or configures logging.

The flags stop here: each command's config is loaded and resolved here, once
(:func:`digenrl.config.resolve_mode`), and the layers below take it with typed, frozen
options built from the rest of the flags (:class:`~digenrl.launch.LaunchOptions`,
:class:`~digenrl.actors.node.NodeOptions`, :class:`~digenrl.sim.plan.PlanOptions`).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from digenrl.config import CONFIG_ERROR_EXIT, MODES, Config, ConfigError, load_config, resolve_mode

if TYPE_CHECKING:
    from digenrl.config import ResolvedConfig
    from digenrl.launch import LaunchOptions


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="TOML config (default: embedded tiny-cpu.toml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set train.lr=1e-4 (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="digenrl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("launch", help="run a local cluster (or the colocated loop) to the end")
    _add_config_args(p)
    p.add_argument("--mode", choices=MODES, default=None, help="override run.mode")
    p.add_argument("--rollouts", type=int, default=None, help="rollout processes")
    p.add_argument("--trainers", type=int, default=None, help="trainer ranks")
    p.add_argument("--rewards", type=int, default=None,
                   help="reward worker processes hosting the reward terms (default cluster.rewards: 0)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps")
    p.add_argument("--run-dir", default=None, help="output folder (default runs/<mode>-<time>)")
    p.add_argument("--resume", default=None, metavar="RUN_DIR", help="continue a run from its checkpoint")
    p.add_argument("--record", action="store_true", help="record rollout fragments for --trainer-only")
    p.add_argument("--rollout-only", action="store_true",
                   help="debug: run rollouts alone (no training, weights stay at version 0)")
    p.add_argument("--trainer-only", default=None, metavar="RECORDING",
                   help="debug: run trainers alone fed from a recording")

    p = sub.add_parser("plan", help="predict throughput and bubbles with the simulator, or (--memory) "
                                    "each role's peak device memory")
    p.add_argument("--config", default=None, help="model / run config TOML")
    p.add_argument("--cluster", default=None, help="cluster TOML (GPU types per role)")
    p.add_argument("--modes", default="colocated,disagg-sync,digenrl")
    p.add_argument("--steps", type=int, default=None, help="simulated steps (default: the planner's)")
    p.add_argument("--cost", default=None, metavar="FIT.json", help="cost model fitted by --calibrate")
    p.add_argument("--json", action="store_true")
    p.add_argument("--timeline", default=None, metavar="PNG")
    p.add_argument("--search", action="store_true", help="search the rollout/trainer split")
    p.add_argument("--calibrate", default=None, metavar="RUN_DIR", help="fit the cost model to a run")
    p.add_argument("--memory", action="store_true",
                   help="predict each role's peak device memory (trainer, rollout) from the model's real "
                        "shapes on the meta device, whether it fits the GPU, and the smallest setting that does")

    p = sub.add_parser("report", help="summary table and plots of a run dir")
    p.add_argument("run_dir")
    p.add_argument("--out", default=None, help="where PNGs go (default RUN_DIR/report)")

    p = sub.add_parser("eval", help="held-out evaluation of a run's saved policy ([eval] of its config)")
    p.add_argument("run_dir")
    p.add_argument("--checkpoint", default=None, metavar="PATH",
                   help="policy.safetensors or its folder (default RUN_DIR/final; a sharded "
                        "checkpoint/vN/ is read whole); 'base' for version 0")
    p.add_argument("--out", default=None, help="where eval/ and samples/ go (default RUN_DIR)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override the run's config, e.g. --set eval.prompts=32 (repeatable)")

    p = sub.add_parser("export", help="a run's trained policy as a standalone diffusers folder with a model card")
    p.add_argument("run_dir")
    p.add_argument("--out", required=True, metavar="DIR", help="the folder to write (new or empty)")
    p.add_argument("--merge", action="store_true",
                   help="fold a LoRA into the transformer's weights (plain diffusers loads it, no peft); "
                        "without it the adapter sits beside the base pipeline")
    p.add_argument("--ema", action="store_true",
                   help="export the EMA of the weights (final/ema/, train.ema_decay > 0) instead of the policy")

    p = sub.add_parser("keys", help="CurveZMQ keys")
    ks = p.add_subparsers(dest="keys_command", required=True)
    g = ks.add_parser("generate", help="write server and client key pairs into DIR")
    g.add_argument("dir")
    g.add_argument("--names", default="server,client", help="comma-separated key names")

    sub.add_parser("node", help="run one role by hand: the same as digenrl-node (see digenrl-node --help)")
    p = sub.add_parser("config", help="print the resolved config as TOML")
    _add_config_args(p)
    p.add_argument("--mode", choices=MODES, default=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["node"]:  # `digenrl node ARGS` is `digenrl-node ARGS` (how launch starts children)
        return node_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        if args.command == "launch":
            from digenrl.launch import run_launch
            return run_launch(*launch_inputs(args))
        if args.command == "config":
            from digenrl.config import to_toml
            cfg = resolve_mode(load_config(args.config, args.overrides), args.mode)
            sys.stdout.write(to_toml(cfg))
            return 0
        if args.command == "report":
            from digenrl.telemetry.report import make_report
            if not Path(args.run_dir).is_dir():
                raise UsageError(f"report {args.run_dir}: no such run folder")
            make_report(Path(args.run_dir), Path(args.out) if args.out else None)
            return 0
        if args.command == "eval":
            import json

            from digenrl.launch import evaluate_run
            row = evaluate_run(Path(args.run_dir), args.checkpoint, args.overrides,
                               Path(args.out) if args.out else None)
            print(json.dumps(row, indent=1))
            return 0
        if args.command == "export":
            from digenrl.export import export_run
            res = export_run(Path(args.run_dir), Path(args.out), merge=args.merge, ema=args.ema)
            print(f"digenrl: exported the {res['kind']} of policy version {res['version']}"
                  f"{' (LoRA merged)' if res['merged'] else ''} from {res['from']} to {res['out']}")
            return 0
        if args.command == "keys":
            from digenrl.transport.curve import generate_keys
            written = generate_keys(Path(args.dir), names=tuple(args.names.split(",")))
            for name, (public, secret) in written.items():
                print(f"{name}: public {public}  secret {secret}")
            return 0
        if args.command == "plan":
            return _plan(args)
    except Exception as e:
        code = exit_code(e)
        if code is None:
            raise  # a bug of ours: the traceback is what a report needs
        print(f"digenrl: {one_line(e)}", file=sys.stderr)
        return code
    raise AssertionError(args.command)


def _with_counts(cfg: Config, args: argparse.Namespace, mode: str | None) -> Config:
    """``cfg`` with --steps / --rollouts / --rewards / --trainers applied, each checked (one-line errors)."""
    run, cl = cfg.run, cfg.cluster
    if args.steps is not None:
        if args.steps < 1:
            raise ConfigError(f"--steps {args.steps}: expected at least 1")
        run = dataclasses.replace(run, steps=args.steps)
    if args.rollouts is not None:
        if args.rollouts < 0:
            raise ConfigError(f"--rollouts {args.rollouts}: expected 0 or more")
        if args.rollouts == 0 and (mode or cfg.run.mode) != "colocated":
            raise ConfigError(f"--rollouts 0: mode {mode or cfg.run.mode} needs at least one "
                              "rollout (only colocated runs without them)")
        cl = dataclasses.replace(cl, rollouts=args.rollouts)
    if args.rewards is not None:
        if args.rewards < 0:
            raise ConfigError(f"--rewards {args.rewards}: expected 0 or more")
        cl = dataclasses.replace(cl, rewards=args.rewards)
    if args.trainers is not None:
        if args.trainers < 1:
            raise ConfigError(f"--trainers {args.trainers}: expected at least 1")
        cl = dataclasses.replace(cl, trainers=args.trainers)
    return dataclasses.replace(cfg, run=run, cluster=cl)


def launch_inputs(args: argparse.Namespace) -> tuple[ResolvedConfig, LaunchOptions]:
    """``digenrl launch``'s flags as the resolved config and the options the launch takes: the
    config (``--config``, or with ``--resume`` the run's own config.toml) with ``--set`` and the
    counts applied, resolved for ``--mode``. ConfigError, in one line, for what the flags cannot ask."""
    from digenrl.launch import LaunchOptions

    opts = LaunchOptions(run_dir=args.run_dir, resume=args.resume, record=args.record,
                         rollout_only=args.rollout_only, trainer_only=args.trainer_only)
    if args.resume is None:
        return resolve_mode(_with_counts(load_config(args.config, args.overrides), args, args.mode),
                            args.mode), opts
    for flag in ("mode", "config", "run_dir"):
        if getattr(args, flag) is not None:
            raise ConfigError(f"--resume {args.resume}: --{flag.replace('_', '-')} cannot be "
                              "changed on resume (the run continues with its own config.toml)")
    saved = Path(args.resume) / "config.toml"
    if not saved.is_file():
        raise ConfigError(f"--resume {args.resume}: no config.toml in that folder (not a run dir)")
    return resolve_mode(_with_counts(load_config(saved, args.overrides), args, None)), opts


def _plan(args: argparse.Namespace) -> int:
    """``digenrl plan``: a calibration, or the config (--config, --steps) in each mode."""
    from digenrl.sim.plan import PlanOptions, calibrate_run, run_plan

    if args.calibrate:
        return calibrate_run(args.calibrate)
    cfg = load_config(args.config)
    if args.memory:
        from digenrl.sim.memory import run_memory_plan
        return run_memory_plan(cfg, args.cluster, args.json)
    if args.steps is not None:
        if args.steps < 2:
            raise ConfigError(f"--steps {args.steps}: expected at least 2 (steady state needs two)")
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, steps=args.steps))
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    return run_plan(cfg, PlanOptions(cluster=args.cluster, modes=modes, cost=args.cost, json=args.json,
                                     timeline=args.timeline, search=args.search))


class UsageError(ValueError):
    """A command named something that is not there; the message says what."""


def exit_code(e: BaseException) -> int | None:
    """2 for what the user asked wrongly (config, arguments, input files, addresses), 1 for a
    run that failed (a broken checkpoint, a full or read-only disk, no recovery left), None for
    anything else (a bug: it keeps its traceback)."""
    from digenrl.actors.base import RunFailed
    from digenrl.actors.connect import ConnectFailed
    from digenrl.clusterenv import EnvError
    from digenrl.data.prompts import PromptError
    from digenrl.fileio import DamagedFile
    from digenrl.rl.checkpoint import CheckpointError
    from digenrl.transport.curve import CurveKeyError
    from digenrl.transport.errors import EndpointError
    from digenrl.transport.security import PlaintextRefused
    if isinstance(e, ConnectFailed):
        return e.code
    if isinstance(e, ConfigError | UsageError | PromptError | EndpointError | PlaintextRefused
                  | CurveKeyError | EnvError):
        return 2
    if isinstance(e, CheckpointError | RunFailed | DamagedFile | OSError):
        return 1
    return None


def one_line(e: BaseException) -> str:
    """The error as one line: its kind, then its message (an OSError names its file)."""
    if isinstance(e, ConfigError):
        text = f"config error: {e}"
    elif isinstance(e, OSError) and e.strerror:
        where = f": {e.filename}" if e.filename else ""
        text = f"{e.strerror}{where}"
    else:
        text = str(e)
    return " ".join(text.split())


def _seconds(text: str) -> float:
    """A positive, finite number of seconds (argparse type)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected seconds") from None
    if not 0 < value < 1e6:
        raise argparse.ArgumentTypeError(f"{text!r}: expected seconds > 0")
    return value


def build_node_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="digenrl-node", description="run one DigenRL role by hand")
    p.add_argument("--role", default=None, choices=["coordinator", "rollout", "trainer", "reward"],
                   help="required unless --from-env gives it from the rank")
    p.add_argument("--coordinator", default=None, metavar="ENDPOINT",
                   help="coordinator control address, e.g. tcp://10.0.0.1:5555 (nodes)")
    p.add_argument("--bind", default=None, metavar="ENDPOINT",
                   help="address to bind (coordinator: control ROUTER; trainer: data PULL; reward: requests ROUTER)")
    p.add_argument("--gpu", default=None, help="GPU type this node declares (H100, L40S, cpu, ...)")
    p.add_argument("--device", default=None, metavar="DEVICE",
                   help="cpu, cuda or cuda:N (default: cuda:LOCAL_RANK, else the first visible GPU, else cpu)")
    p.add_argument("--node-id", default=None, help="stable node id (default role-host-pid)")
    p.add_argument("--gpus", type=int, default=None, metavar="N",
                   help="rollout: run each trajectory over N processes, one per device: this node's "
                        "device (cuda:i) and the next N-1 it sees, or N processes on the CPU "
                        "(sequence parallelism; overrides cluster.rollout_gpus for this node)")
    p.add_argument("--rank", type=int, default=None,
                   help="trainer: informational rank hint (ranks are assigned in join order)")
    p.add_argument("--run-dir", default=None, help="run folder (coordinator writes metrics there)")
    p.add_argument("--prometheus-port", type=int, default=None,
                   help="serve this node's counters and NVML readings for Prometheus (metrics extra); "
                        "a coordinator serves the run's last step record")
    p.add_argument("--prometheus-addr", default="0.0.0.0",
                   help="address the Prometheus endpoint binds (default every interface; 127.0.0.1 keeps it local)")
    p.add_argument("--allow-plaintext", action="store_true",
                   help="permit an unencrypted bind on a non-loopback address (warns)")
    p.add_argument("--connect-timeout", type=_seconds, default=30.0, metavar="S",
                   help="no Welcome from the coordinator within S seconds: say what answers there, "
                        "and again at growing intervals while retrying (default 30)")
    p.add_argument("--exit-on-connect-failure", action="store_true",
                   help="stop with a one-line error (exit 1) instead of retrying after --connect-timeout")
    g = p.add_argument_group("cluster launchers (digenrl/clusterenv.py, ops/)")
    g.add_argument("--from-env", action="store_true",
                   help="rank, world and coordinator from Slurm, torchrun or Kubernetes variables: start "
                        "this task's nodes (one per local GPU) and, on rank 0, the coordinator")
    g.add_argument("--trainers", type=int, default=1, help="--from-env: the first N global ranks train")
    g.add_argument("--gpus-per-node", type=int, default=0,
                   help="--from-env: nodes per task when the launcher started one task per host")
    g.add_argument("--coordinator-port", type=int, default=5555)
    g.add_argument("--dry-run", action="store_true", help="--from-env: print the processes, start none")
    _add_config_args(p)
    return p


def _check_gpus_flag(args: argparse.Namespace) -> None:
    """``--gpus N`` is a rollout's (N >= 1). ``--from-env`` starts one node per local GPU, so
    neither ``--gpus`` nor, where it starts rollouts, a config's ``cluster.rollout_gpus`` > 1
    combines with it: each node there is given one GPU, and a rollout group's followers
    would take its neighbours'."""
    if args.gpus is not None:
        if args.gpus < 1:
            raise ConfigError(f"--gpus {args.gpus}: expected 1 or more")
        if args.from_env:
            raise ConfigError(f"--gpus {args.gpus} with --from-env: it starts one node per local GPU; "
                              "start a rollout over several GPUs by hand (--role rollout --gpus N)")
        if args.role != "rollout":
            raise ConfigError(f"--gpus {args.gpus} with --role {args.role}: only a rollout node runs "
                              "over several devices (a trainer rank or reward worker takes one)")
    elif args.from_env and args.role in (None, "rollout") and (args.config is None or Path(args.config).is_file()):
        # it may start rollouts; a config that is not here (a --dry-run elsewhere) is the nodes' to read
        g = load_config(args.config, args.overrides).cluster.rollout_gpus
        if g > 1:
            raise ConfigError(f"cluster.rollout_gpus = {g} with --from-env: it starts one node per local "
                              "GPU; start rollouts over several GPUs by hand (--role rollout --gpus N) "
                              "or with `digenrl launch`")


def node_main(argv: list[str] | None = None) -> int:
    parser = build_node_parser()
    args = parser.parse_args(argv)
    if args.role is None and not args.from_env:
        parser.error("the following arguments are required: --role (or --from-env)")
    from digenrl.rl.rewards import RewardError
    try:
        _check_gpus_flag(args)
        if args.from_env:  # the config is read by the processes it starts
            from digenrl.clusterenv import run_from_env
            extra = [*(["--config", args.config] if args.config else []),
                     *(x for s in args.overrides for x in ("--set", s)),
                     *(["--run-dir", args.run_dir] if args.run_dir else []),
                     *(["--allow-plaintext"] if args.allow_plaintext else [])]
            return run_from_env(role=args.role, trainers=args.trainers, coordinator_port=args.coordinator_port,
                                gpus_per_node=args.gpus_per_node, gpu=args.gpu, dry_run=args.dry_run,
                                extra=extra)
        from digenrl.actors.node import NodeOptions, run_node
        if args.coordinator:  # a bad address is refused before anything is built
            from digenrl.transport.endpoints import Endpoint
            Endpoint.parse(args.coordinator)
        if args.bind:
            from digenrl.transport.endpoints import Endpoint
            Endpoint.parse(args.bind)
        opts = NodeOptions(role=args.role, coordinator=args.coordinator, bind=args.bind, gpu=args.gpu,
                           device=args.device, node_id=args.node_id, run_dir=args.run_dir,
                           prometheus_port=args.prometheus_port, prometheus_addr=args.prometheus_addr,
                           allow_plaintext=args.allow_plaintext, connect_timeout_s=args.connect_timeout,
                           exit_on_connect_failure=args.exit_on_connect_failure, gpus=args.gpus)
        overrides = [*args.overrides, *(["transport.allow_plaintext=true"] if args.allow_plaintext else [])]
        return run_node(resolve_mode(load_config(args.config, overrides)), opts)
    except Exception as e:
        # a reward that cannot be built refuses the same way on every restart: a config error
        code = CONFIG_ERROR_EXIT if isinstance(e, RewardError) else exit_code(e)
        if code is None:
            raise
        print(f"digenrl-node: {one_line(e)}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
