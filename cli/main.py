"""``seerctl``: start, stop, status, rollout, bench, trace, model prepare.

The CLI is the only place that reads environment variables (``SEER_RUN_DIR``,
``SEER_CACHE_DIR``) and the config file path; everything below it takes values.
Exit codes: 0 ok, 1 a failed operation (message on stderr), 2 bad usage or input (a
bad flag or file, a value the client cannot send, or a request the daemon refused as
invalid), always as one line without a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from rich.console import Console

from seer.config import ConfigError, SeerConfig, default_cache_dir, default_run_dir, load_config

err = Console(stderr=True)

# Daemon error codes that mean the request itself was bad: exit code 2, like bad input
# caught before sending (the others, e.g. no_engines or busy, are failed operations: 1).
INPUT_REFUSALS = frozenset({
    "empty_rollout", "too_many_prompts", "bad_group_size", "bad_prompt", "bad_token_ids", "prompt_too_long",
    "bad_sampling", "unknown_policy", "invalid_message", "frame_too_large", "duplicate_rollout",
    "needs_true_lengths", "bad_true_lengths", "speculative_unsupported",
})


def _run_dir(args: argparse.Namespace) -> Path:
    raw = args.run_dir or os.environ.get("SEER_RUN_DIR") or str(default_run_dir())
    return Path(raw).expanduser().resolve()


def _cache_dir(args: argparse.Namespace) -> Path:
    raw = getattr(args, "cache_dir", None) or os.environ.get("SEER_CACHE_DIR") or str(default_cache_dir())
    return Path(raw).expanduser().resolve()


def _config(args: argparse.Namespace) -> SeerConfig:
    import seer.controlplane  # noqa: F401  (registers the policy names the config is checked against)

    return load_config(args.config)


# The daemon runs on the C library's allocator: CPython's own (pymalloc) returns a 1 MiB
# arena only once every object in it is gone, so the few objects that outlive a large
# rollout kept tens of MB of its memory; glibc gives free pages back (``malloc_trim``,
# controlplane/memory.py). Set PYTHONMALLOC to choose otherwise. Engines and other children
# get the environment as it was (``_allocator_chosen``).
DAEMON_ALLOCATOR = "malloc"
_ALLOCATOR_MARK = "SEER_DAEMON_ALLOCATOR"


def _exec_with_allocator() -> None:
    """Re-run this very command (same pid) with ``PYTHONMALLOC=malloc`` unless the
    environment already chooses an allocator."""
    if "PYTHONMALLOC" in os.environ:
        return
    env = {**os.environ, "PYTHONMALLOC": DAEMON_ALLOCATOR, _ALLOCATOR_MARK: DAEMON_ALLOCATOR}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def _allocator_chosen() -> None:
    """In the re-run daemon: the allocator is set for this process; its children (engines,
    the draft server, the KV agent) get the environment without it."""
    if os.environ.pop(_ALLOCATOR_MARK, None) is not None:
        os.environ.pop("PYTHONMALLOC", None)


def cmd_start(args: argparse.Namespace) -> int:
    from seer.cli.daemon import probe_ports, run_foreground, running_daemon, start_background

    if args.foreground:
        _exec_with_allocator()
        _allocator_chosen()
    config = _config(args)
    run_dir = _run_dir(args)
    if args.foreground:
        owner = (args.owner_pid, args.owner_start_time) if args.owner_pid else None
        return run_foreground(config, run_dir, _cache_dir(args), owner=owner)
    # A metrics or OpenAI port in use: one line, before anything starts (a daemon already
    # running on the run dir is refused by start_background with its own message).
    if not running_daemon(run_dir):
        probe_ports(config)
    timeout_s = config.engines.startup_timeout_s + 60
    if config.cluster.launcher == "ray":  # reaching the cluster and placing come before the engines start
        timeout_s += config.cluster.connect_timeout_s + config.cluster.placement_timeout_s
    info = start_background(args.config, run_dir, _cache_dir(args), timeout_s, owner_pid=args.owner_pid)
    if not_ready := info.get("engines_not_ready"):
        # Serving, but not on every engine: never "ready" while an engine is not.
        print(f"Seer daemon running (pid {info['pid']}) on engines {info.get('engines')} only; not ready: "
              f"{_not_ready_text(not_ready)}")
    else:
        print(f"Seer daemon ready (pid {info['pid']}, engines {info.get('engines')})")
    print(f"client address: {info['client_address']}")
    if "metrics_url" in info:
        print(f"metrics: {info['metrics_url']}")
    if "openai_url" in info:
        print(f"openai: {info['openai_url']}")
    print(f"run dir: {run_dir}")
    if args.owner_pid:
        print(f"owner: process {args.owner_pid} (the daemon stops when it exits)")
    return 0


def _not_ready_text(not_ready: dict) -> str:
    """``{"0": "lost (...)"}`` as "engine 0: lost (...)" (a Ray launcher's entry as is)."""
    return "; ".join(f"engine {key}: {why}" if key.isdigit() else why for key, why in not_ready.items())


def cmd_stop(args: argparse.Namespace) -> int:
    from seer.cli.daemon import stop
    from seer.dataplane.kvpool import SEGMENT_PREFIX
    from seer.process import remove_stale_shm
    from seer.weights_segment import remove_orphans

    run_dir = _run_dir(args)
    if stop(run_dir, args.timeout):
        print(f"Seer daemon on {run_dir} stopped")
    else:
        print(f"no Seer daemon running on {run_dir}")
    if stale := remove_stale_shm(SEGMENT_PREFIX):  # of daemons killed on any run dir (the OOM killer)
        print(f"removed {len(stale)} KV pool segment(s) of daemons that are gone: {', '.join(stale)}")
    if orphans := remove_orphans():  # a trainer killed with its resource tracker (weights_segment.py)
        print(f"removed {len(orphans)} weight segment(s) of trainers that are gone: {', '.join(orphans)}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    import msgspec

    from seer.cli.daemon import running_daemon
    from seer.client import SeerClient

    run_dir = _run_dir(args)
    info = running_daemon(run_dir)
    if info is None:
        err.print(f"no Seer daemon running on {run_dir}; start one with `seerctl start`")
        return 1
    from seer.auth import ClientKeys

    with SeerClient(info["client_address"], timeout_s=args.timeout, keys=ClientKeys.from_info(info)) as client:
        status = client.status()
    if args.json:
        print(json.dumps(msgspec.to_builtins(status), indent=2))
        return 0
    from rich.table import Table

    console = Console()
    console.print(f"daemon pid {status.pid} · policy {status.policy} · weights v{status.weights_version} · "
                  f"run dir {status.run_dir}")
    if owner := info.get("owner_pid"):
        console.print(f"owned by process {owner}: stops when it exits")
    if status.openai_url:
        console.print(f"OpenAI-compatible endpoint {status.openai_url} (agent rollouts)")
    on_ray = any(e.ray_actor_id for e in status.engines)  # [cluster] launcher = "ray": where each runs
    table = Table("engine", "pid", "state", "running", "waiting", "KV use", "preemptions", "KV tokens",
                  *(("node IP", "Ray actor") if on_ray else ()))
    for e in status.engines:
        table.add_row(str(e.engine_id), str(e.pid), e.state, str(e.load.num_running), str(e.load.num_waiting),
                      f"{e.load.kv_usage:.1%}", str(e.load.num_preemptions),
                      str(e.capabilities.kv_capacity_tokens) if e.capabilities else "-",
                      *((e.node_ip or "-", e.ray_actor_id or "-") if on_ray else ()))
    console.print(table)
    for r in status.rollouts:
        console.print(f"rollout {r.rollout_id[:8]} ({r.policy}): {r.num_groups_done}/{r.num_groups} groups, "
                      f"{r.num_samples_done}/{r.num_samples} samples, {r.num_output_tokens} tokens, "
                      f"{r.elapsed_s:.1f} s")
    if not status.rollouts:
        console.print("no rollout running")
    if (sch := status.scheduling) is not None:
        console.print(f"step cost (fitted from {sch.num_step_records} engine steps, {sch.num_step_records_refused} "
                      f"refused): {sch.step_fixed_s * 1e3:.1f} ms + {sch.step_per_seq_s * 1e3:.2f} ms/sequence + "
                      f"{sch.step_per_kv_token_s * 1e6:.2f} us/KV token + {sch.step_per_prefill_token_s * 1e3:.3f} "
                      "ms/prefilled token")
        choices = f"policy {sch.policy}: placement {sch.placement}"
        if sch.whole_samples:
            choices += ", whole samples (the engines' KV holds the rollout's expected work)"
        elif sch.chunk_size_tokens:
            choices += f", chunks of {sch.chunk_size_tokens} tokens"
        if sch.admission_margin_sd is not None:
            choices += (f", KV admission margin {sch.admission_margin_sd:+.2f} sd (accepts {sch.overflow_odds:.0%} "
                        "odds of a preemption)")
        console.print(choices)
    return 0


def _rollout_keys(args: argparse.Namespace, info: dict, config: SeerConfig):
    """CURVE keys for `seerctl rollout`: --keys DIR, else the daemon's daemon.json, else
    the config's [server] client keys; None on ipc:// or a daemon without CURVE."""
    from seer.auth import ClientKeys, is_tcp

    if args.keys:
        return ClientKeys.from_dir(Path(args.keys).expanduser())
    if not is_tcp(info["client_address"]):
        return None
    return ClientKeys.from_info(info) or ClientKeys.from_config(config.server)


def cmd_rollout(args: argparse.Namespace) -> int:
    from seer.cli import preflight
    from seer.cli.daemon import probe_ports, running_daemon, start_background, stop
    from seer.cli.rollout import check_inputs, read_prompts, rollout_main
    from seer.protocol import SamplingParams

    config = _config(args)
    d = config.rollout
    sampling = SamplingParams(
        max_tokens=args.max_tokens if args.max_tokens is not None else d.max_tokens,
        temperature=args.temperature if args.temperature is not None else d.temperature,
        top_p=args.top_p if args.top_p is not None else d.top_p,
        seed=args.seed,
    )
    group_size = args.group_size if args.group_size is not None else d.group_size
    console = Console()
    explicit_run_dir = args.run_dir or os.environ.get("SEER_RUN_DIR")
    run_dir = _run_dir(args)
    if args.address and not args.out:
        err.print("seerctl: --address needs --out (there is no local run dir to write results to)")
        return 2
    # Everything that can be checked without an engine is checked before a daemon is
    # started (cli/preflight.py): a typo must not cost an engine start (a minute with vLLM).
    prompts, metas = read_prompts(Path(args.prompts))
    check_inputs(group_size, sampling, args.policy, args.timeout)
    true_lengths = preflight.read_true_lengths(Path(args.true_lengths)) if args.true_lengths else None
    explicit_keys = _rollout_keys(args, {"client_address": ""}, config) if args.keys else None
    if args.address:
        # A daemon elsewhere (another host): no run dir to read, never an embedded daemon.
        info, embedded = {"client_address": args.address}, False
    else:
        info = running_daemon(run_dir)
        embedded = info is None
    # The limits and default policy: this config's for an embedded daemon, daemon.json's for
    # a local one; a daemon elsewhere checks for itself (only an explicit --policy is known).
    limits = preflight.DaemonLimits.of_config(config) if embedded else preflight.DaemonLimits.of_info(info or {})
    preflight.check_policy_needs(args.policy or (limits.policy if limits else None), true_lengths, args.prompts)
    request = preflight.rollout_request(prompts, group_size, sampling, args.policy, true_lengths)
    if limits is not None:
        preflight.check_request(request, limits)
    elif isinstance(size_limit := (info or {}).get("max_request_bytes"), int):  # a daemon.json without the others
        preflight.check_size(request, size_limit)
    if embedded:
        if not explicit_run_dir:
            run_dir = (Path("runs") / time.strftime("rollout-%Y%m%d-%H%M%S")).resolve()
        model_path = preflight.check_embedded_config(config, run_dir, _cache_dir(args))
        preflight.check_prompt_lengths(prompts, sampling, config, model_path, args.prompts)
    out = Path(args.out) if args.out else run_dir / "rollout.jsonl"
    preflight.check_out_path(out)
    if embedded:
        probe_ports(config)  # a metrics or OpenAI port in use: one line, nothing started
        console.print(f"no daemon running: starting an embedded one on {run_dir} "
                      f"({config.engines.count} x {config.engines.backend} engines) …")
        t0 = time.monotonic()
        # Owned by this process: a seerctl killed by any signal (SIGKILL too) takes the daemon with it.
        info = start_background(args.config, run_dir, _cache_dir(args), config.engines.startup_timeout_s + 60,
                                owner_pid=os.getpid())
        console.print(f"engines ready in {time.monotonic() - t0:.1f} s")
        if not_ready := info.get("engines_not_ready"):
            console.print(f"[yellow]running on engines {info.get('engines')}; not ready: "
                          f"{_not_ready_text(not_ready)}[/yellow]")
    keys = explicit_keys or _rollout_keys(args, info, config)
    try:
        rollout_main(info["client_address"], (prompts, metas), group_size, sampling, args.policy, out, console,
                     keys=keys, timeout_s=args.timeout, scheduler=config.scheduler, true_lengths=true_lengths)
    finally:
        if embedded:
            stop(run_dir, 60.0)
            console.print(f"embedded daemon stopped; logs in {run_dir}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from seer.cli.bench import bench_problem, results_table, run_bench, run_sweep

    console = Console(width=max(150, Console().width))  # the table has up to 12 columns
    policies = [p for p in args.policies.split(",") if p]
    if problem := bench_problem(args.workload, args.scale, policies, args.engines, args.kv_tokens,
                                args.chunk_tokens, args.icc, args.log_sigma):
        err.print(f"seerctl bench: {problem}", markup=False, highlight=False, soft_wrap=True)
        return 2
    if args.plot:
        from seer.cli.plots import plot_unavailable

        if problem := plot_unavailable():  # before minutes of simulation, not after
            err.print(f"seerctl: {problem}", markup=False, highlight=False)
            return 1
    if args.sweep:
        console.print(run_sweep(args.scale, args.cost, args.kv_tokens, args.chunk_tokens, args.seed, console))
        return 0
    try:
        results = run_bench(args.workload, args.scale, policies, args.engines, args.cost, args.kv_tokens,
                            args.chunk_tokens, args.seed, console, icc=args.icc, log_sigma=args.log_sigma)
    except ValueError as exc:  # a trace file that is empty or not a rollout's results, a KV too small, ...
        err.print(f"seerctl bench: {exc}", markup=False, highlight=False, soft_wrap=True)
        return 2
    console.print(results_table(results))
    if args.plot:
        from seer.cli.plots import save_bench_plot

        save_bench_plot(results, Path(args.plot))
        console.print(f"plot written to {args.plot}")
    return 0


def cmd_trace(args: argparse.Namespace) -> int:
    from seer.cli.trace import trace_command

    return trace_command(args)


def cmd_engine(args: argparse.Namespace) -> int:
    from seer.cli.engine import join

    return join(_config(args), args.join, _cache_dir(args), Path(args.log_file) if args.log_file else None)


def cmd_keys(args: argparse.Namespace) -> int:
    from seer.auth import generate_keys

    files = generate_keys(Path(args.dir).expanduser().resolve())
    print(f"server keypair: {files['server_secret']} (secret: the daemon only), {files['server_public']} (public)")
    print(f"client keypair: {files['client_secret']} (secret), {files['client_public']} (public)")
    print(f"authorized client keys: {files['authorized']}/ (copy other hosts' .key files here)")
    print("seer.toml [server]: curve_server_secret_key, curve_authorized_keys, curve_server_public_key, "
          "curve_client_secret_key (docs/operations.md)")
    return 0


def cmd_model_prepare(args: argparse.Namespace) -> int:
    from seer.engines.model_store import prepare

    prepare(_cache_dir(args))
    return 0


def _pid(text: str) -> int:
    if not text.isdigit() or int(text) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a process id")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="seerctl", description="Seer rollout service")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser, config: bool = True) -> None:
        p.add_argument("--run-dir", help="daemon run dir (default: $SEER_RUN_DIR or ~/.seer/run)")
        if config:
            p.add_argument("--config", help="seer.toml (default: the embedded defaults)")
            p.add_argument("--cache-dir", help="model cache (default: $SEER_CACHE_DIR or ~/.cache/seer)")

    p = sub.add_parser("start", help="start the daemon (control plane + engines)")
    common(p)
    p.add_argument("--foreground", action="store_true", help="run in this process (for supervisors)")
    p.add_argument("--owner-pid", type=_pid, metavar="PID",
                   help="stop the daemon (engines, KV pool) when process PID exits, by any signal: for a "
                        "daemon started for one trainer (default: runs until `seerctl stop`)")
    p.add_argument("--owner-start-time", type=int, help=argparse.SUPPRESS)  # start_background: PID's /proc start time
    p.set_defaults(func=cmd_start)

    p = sub.add_parser("stop", help="drain and stop the daemon")
    common(p, config=False)
    p.add_argument("--timeout", type=float, default=60.0)
    p.set_defaults(func=cmd_stop)

    p = sub.add_parser("status", help="engines, rollout progress, policy, weights version")
    common(p, config=False)
    p.add_argument("--json", action="store_true")
    p.add_argument("--timeout", type=float, default=10.0)
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("rollout", help="run one rollout (starts an embedded daemon if none runs)")
    common(p)
    p.add_argument("--prompts", required=True, help="JSONL: {id, prompt | messages | prompt_token_ids}")
    p.add_argument("--group-size", type=int)
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--policy", help="context | divided | group | request (default: the config's "
                   "scheduler.policy); the oracles (oracle, oracle-full, oracle-group, oracle-order) need "
                   "--true-lengths")
    p.add_argument("--true-lengths", metavar="FILE",
                   help="true output lengths for an oracle --policy: the --out file of "
                   "benchmarks/rollout_policies.py (its first run) or the results JSONL of an earlier "
                   "`seerctl rollout` of the same prompts with the same --group-size, --max-tokens and --seed")
    p.add_argument("--out", help="results JSONL (default: RUN_DIR/rollout.jsonl); its folder must be writable")
    p.add_argument("--address", help="client address of a running daemon (e.g. tcp://head:5555) instead of a run dir")
    p.add_argument("--keys", metavar="DIR", help="CURVE keys written by `seerctl keys` (server.key, client.key_secret) "
                   "for a tcp:// daemon (default: the daemon's daemon.json, else the config's [server] keys)")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds without an answer from the daemon before giving up")
    p.set_defaults(func=cmd_rollout)

    p = sub.add_parser("bench", help="compare policies on a simulated workload (paper scale)")
    p.add_argument("--workload", default="qwen2-vl-72b",
                   help="moonlight | qwen2-vl-72b | kimi-k2, or a rollout JSONL written by `seerctl rollout`")
    p.add_argument("--scale", type=float, default=1.0, help="shrink requests and lengths (synthetic workloads)")
    p.add_argument("--policies", default="group,request,divided,context,oracle")
    p.add_argument("--engines", type=int, default=16)
    p.add_argument("--cost", choices=["gpu", "cpu"], default="gpu")
    p.add_argument("--kv-tokens", type=int, default=1_000_000, help="KV capacity per engine, tokens")
    p.add_argument("--chunk-tokens", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--icc", type=float, default=0.5,
                   help="within-group correlation of log lengths, in [0, 1) (synthetic workloads)")
    p.add_argument("--log-sigma", type=float, default=1.0,
                   help="standard deviation of log lengths, > 0: tail heaviness (synthetic workloads)")
    p.add_argument("--sweep", action="store_true",
                   help="divided/context/oracle-group/oracle over icc 0.2/0.5/0.8 x log sigma 0.6/1.0/1.4 x the three shapes; "
                        "--scale shrinks each shape, its engines and KV")
    p.add_argument("--plot", metavar="FILE.png", help="write throughput/tail bars and per-engine timelines")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("trace", help="summarise a rollout from a run dir's logs; --plot draws its timeline")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a daemon run dir (or its controlplane.log)")
    p.add_argument("--rollout", help="rollout id or prefix, or 'all' (default: the last one in the log)")
    p.add_argument("--plot", metavar="FILE.png", help="write a timeline: engines x time, chunks coloured by group")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=cmd_trace)

    p = sub.add_parser("engine", help="run one engine that joins a running control plane")
    p.add_argument("--join", required=True, metavar="ADDRESS", help="the daemon's engine address (tcp:// or ipc://)")
    p.add_argument("--config", help="seer.toml: [engines], [model], [server] CURVE keys (default: embedded)")
    p.add_argument("--cache-dir", help="model cache (default: $SEER_CACHE_DIR or ~/.cache/seer)")
    p.add_argument("--log-file", help="JSON-lines log file (default: stderr only)")
    p.set_defaults(func=cmd_engine)

    p = sub.add_parser("keys", help="generate CURVE keypairs for tcp:// (server, client, authorized/)")
    p.add_argument("dir", metavar="DIR")
    p.set_defaults(func=cmd_keys)

    p = sub.add_parser("model", help="model provisioning")
    msub = p.add_subparsers(dest="model_command", required=True)
    mp = msub.add_parser("prepare", help="convert the bundled SmolLM2 GGUF into an HF folder (once)")
    mp.add_argument("--cache-dir")
    mp.set_defaults(func=cmd_model_prepare)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from seer.cli.daemon import DaemonError
    from seer.cli.rollout import InputError
    from seer.auth import AuthError
    from seer.cli.engine import JoinError
    from seer.client import SeerError, SeerInputError, SeerServiceError
    from seer.engines.model_store import ModelProvisionError

    try:
        return args.func(args)
    except (InputError, SeerInputError) as exc:
        print(f"seerctl: {exc}", file=sys.stderr)  # one line, never wrapped by the console
        return 2
    except SeerServiceError as exc:
        err.print(f"seerctl: {exc}", markup=False, highlight=False, soft_wrap=True)
        return 2 if exc.code in INPUT_REFUSALS else 1
    except ConfigError as exc:
        err.print(f"seerctl: {exc}", markup=False, highlight=False, soft_wrap=True)
        return 2
    except (DaemonError, SeerError, ModelProvisionError, JoinError, AuthError) as exc:
        err.print(f"seerctl: {exc}", markup=False, highlight=False, soft_wrap=True)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
