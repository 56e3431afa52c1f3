"""`kvpilot tune` (offline on the twin, or live against a local engine) and `kvpilot tuner`
(the in-cluster tuner process).  Heavy imports live inside the handlers."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from kvpilot.api.tuned import TUNED
from kvpilot.api.vocabulary import ENV_TUNER_STORAGE
from kvpilot.twin.calibration import CPU_PROFILE
from kvpilot.twin.flags import positive_int

DEFAULT_TUNER_STORAGE = "sqlite:////var/lib/kvpilot/tuner.db"
DEFAULT_TUNE_STORAGE = "sqlite:///out/kvpilot-tune.db"

TUNE_EPILOG = """\
examples:
  kvpilot tune --offline
  kvpilot tune --offline --model Qwen2.5-7B --gpu A100-80GB --workload rag --slo ttft=1.0,itl=0.1 \\
      --trials 30 --report out/report.html
  kvpilot tune --offline --workload prompt=lognormal/1500/0.6,output=200,cv=1.5
  KVPILOT_TUNER_STORAGE=postgresql://kv:PASS@db/optuna kvpilot tune --offline --workers 2
  KVPILOT_TUNER_STORAGE=postgresql://kv:PASS@db/optuna kvpilot tune --offline --join --study-name sweep \
      --trials 60          # the same command on every machine (a Job's pods): 60 trials in all
  kvpilot tune --local --prometheus http://127.0.0.1:9090 --trials 8 --window 300 -- \\
      kvpilot twin serve --model Llama-3.1-8B --port 8000

exit status: 0 an answer; 1 no config met the SLO; 2 bad input; 65 the study file is not a
database or is damaged; 69 the study's database server cannot be reached (down, wrong host or port,
login refused); 73 the study or the report cannot be written (read-only, no permission);
74 the disk is full (or a file size limit); the recommended block is printed before the report is
written, so a report that fails does not take the answer with it.

workloads: the twin's workload language (as `kvpilot twin run --workload`): a preset (chat, rag,
decode, bursty, sharegpt) with optional keys, e.g. rag:cv=2, or keys alone,
prompt=LEN,output=LEN[,cv=X], where LEN is N, LO..HI or lognormal/MEDIAN/SIGMA.  The rate is what
the capacity search finds; see `kvpilot twin run --help` for the whole language.
"""


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "tune",
        help="tune maxNumBatchedTokens / gpuMemoryUtilization / maxNumSeqs against a latency SLO",
        description=(
            "Search vLLM's token budget, KV-cache memory fraction and sequence cap with Optuna "
            "(multivariate TPE, vLLM's defaults tried first).  --offline searches the engine twin in "
            "virtual time for the most requests per second within the SLO; --local tunes a running local "
            "engine live, reading p99s and burn rates from Prometheus.  The study is kept in Optuna "
            "storage, so a rerun resumes it.  Prints a results table and, last, the recommended engine "
            "block for an InferenceService."
        ),
        epilog=TUNE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--offline", action="store_true", help="search the engine twin (the default)")
    mode.add_argument("--local", action="store_true", help="tune a local engine process live")
    p.add_argument("--model", default="Llama-3.1-8B",
                   help="the twin's model: a preset, or a local model directory (or its config.json), whose "
                        "config.json gives the shapes (default %(default)s)")
    p.add_argument("--gpu", default="H100-80GB",
                   help="GPU preset: the twin simulates it; live, vLLM's defaults on it fill the tuned flags the "
                        "engine command leaves out (default %(default)s)")
    p.add_argument("--device-profile", default=None, metavar="JSON",
                   help="a measured device instead of the --gpu preset: its peaks and fitted step-time constants "
                        f"(`kvpilot twin calibrate` fits one; vLLM-CPU's on an AMX Xeon ships as {CPU_PROFILE}); "
                        "the twin (--offline, --warm-start) simulates it and vLLM's defaults are those on it")
    p.add_argument("--max-model-len", type=positive_int, default=8192, metavar="TOKENS",
                   help="longest prompt + output in tokens, e.g. 8192 or 32k (default %(default)s)")
    p.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=1, metavar="N",
                   help="GPUs the twin engine shards the model over, as vLLM's flag (default %(default)s)")
    p.add_argument("--workload", default="chat", help="preset or spec, see below (default %(default)s)")
    p.add_argument("--slo", default="ttft=0.5,itl=0.05",
                   help="p99 targets in seconds, ttft=S,itl=S (default %(default)s)")
    p.add_argument("--goal", choices=("capacity", "latency", "gpus"), default="capacity",
                   help="offline: capacity (the most req/s sustained in steady state within the SLO), latency "
                        "(at --rate), or gpus (the fewest GPUs that carry --rate of the workload's mix within the "
                        "SLO: for a service that autoscales); default %(default)s")
    p.add_argument("--rate", type=float, default=5.0, help="offline latency and gpus goals: offered req/s")
    p.add_argument("--probe-seconds", type=float, default=150.0, metavar="S",
                   help="offline capacity: seconds of arrivals (virtual time) each probed rate is served for, the "
                        "first fifth a warm-up that is not measured; long enough for a queue the engine cannot "
                        "keep up with to show in the p99 (default %(default)s)")
    p.add_argument("--trials", type=int, default=30, help="default %(default)s")
    p.add_argument("--seed", type=int, default=0, help="sampler and workload seed (default %(default)s)")
    p.add_argument("--storage", default=None, metavar="URL",
                   help=f"Optuna storage URL (default: ${ENV_TUNER_STORAGE}, else {DEFAULT_TUNE_STORAGE}); "
                        f"several runs with one URL and --study-name share the study.  A URL with a "
                        f"password belongs in ${ENV_TUNER_STORAGE}, out of the process list")
    p.add_argument("--study-name", help="default: derived from the target and a hash of the search space")
    p.add_argument("--workers", type=int, default=1, metavar="N",
                   help="offline: processes this run forks to measure trials of the study side by side, one per "
                        "idle core; this process opens the study first, so on any storage, SQLite included "
                        "(default %(default)s)")
    p.add_argument("--join", action="store_true",
                   help="offline: be one of several independent processes on one study (e.g. the pods of a "
                        "Kubernetes Job with parallelism N, each running the same command), on any machine.  "
                        "No process owns the study: a trial in progress is failed and its config measured "
                        "again only when its worker stopped heart-beating for --grace-period, never a live "
                        "sibling's; --trials is the study's budget, not each process's; every process runs "
                        "until the budget is finished.  Needs a database server (postgresql://...): refused "
                        "with SQLite, whose file one writer locks at a time and whose heartbeats no other "
                        "machine sees (on one machine use --workers N).  Without --join a run owns its study: "
                        "it fails every trial left in progress at once and measures it again")
    p.add_argument("--heartbeat-interval", type=int, default=10, metavar="S",
                   help="with a database server: seconds between the heartbeats a trial's worker records while "
                        "it measures (Optuna's RDB heartbeat; default %(default)s)")
    p.add_argument("--grace-period", type=int, default=60, metavar="S",
                   help="--join: seconds without a heartbeat after which a trial in progress counts as its "
                        "worker's death, is failed and its config queued again; more than --heartbeat-interval "
                        "(default %(default)s)")
    p.add_argument("--report", default=None,
                   help="report file: .html, or .png/.pdf/.svg for the plots alone (default out/STUDY.html, "
                        "one per study; '' for none)")
    for f in TUNED:
        p.add_argument(f"--{f.short}", metavar="MIN:MAX", help=f"{f.name} range (default {f.space[0]:g}:{f.space[1]:g})")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.add_argument("-o", "--output", choices=("yaml", "json"), default="yaml",
                   help="what stdout gets: yaml (default), the recommended spec.engine block to merge into an "
                        "InferenceService (`kvpilot tune ... > engine.yaml`); json, the result as one object. "
                        "The trials table and the rest go to stderr")
    _add_live_arguments(p)
    p.set_defaults(handler=_tune)
    _register_tuner(subparsers)


def _add_live_arguments(p: argparse.ArgumentParser) -> None:
    """`kvpilot tune --local`'s own flags."""
    live = p.add_argument_group("live (--local)")
    live.add_argument("--prometheus", metavar="URL", help="Prometheus that scrapes the engine")
    live.add_argument("--selector", default="", help="extra PromQL label matchers, e.g. job=\"vllm\"")
    live.add_argument("--objective", type=float, default=0.99, help="SLO objective (default %(default)s)")
    live.add_argument("--warmup", type=float, default=120.0, help="seconds after a change before measuring")
    live.add_argument("--window", type=float, default=600.0, help="trial window, seconds")
    live.add_argument("--confirm-windows", type=int, default=1, metavar="N",
                      help="rolling trials: a trial whose first window would make it the best engine is measured "
                           "for N more windows and told their mean (one window's p99 is noisy; a lucky one would "
                           "stand as the mark every later trial must beat); 0 tells every trial on one window "
                           "(default %(default)s)")
    live.add_argument("--poll", type=float, default=15.0, help="burn-rate poll interval, seconds")
    live.add_argument("--fast-burn-window", type=float, default=300.0,
                      help="window of the fast-burn check, seconds (default 300 = 5m)")
    live.add_argument("--slots", metavar="A,B",
                      help="the two backend ports engines alternate on (default: the engine's --port +1 and +2); "
                           "clients and Prometheus use the engine's --port")
    live.add_argument("--trial-strategy", choices=("rolling", "canary"), default="rolling",
                      help="rolling: each trial engine replaces the engine in force; canary: it runs beside it "
                           "(a second process on --canary-port) taking --canary-weight of new connections, both "
                           "measured in the same window and compared paired.  Canary needs Prometheus to scrape "
                           "the canary port with kvpilot_dev_track=\"canary\" and the slots with "
                           "kvpilot_dev_track=\"stable\" (the run logs the scrape configs); default %(default)s")
    live.add_argument("--canary-port", type=int, metavar="P",
                      help="canary: the canary engine's port (default: the engine's --port + 3)")
    live.add_argument("--canary-weight", type=float, default=0.25, metavar="W",
                      help="canary: its share of new connections, in (0, 1) (default %(default)s: stable 3 : canary 1)")
    live.add_argument("--warm-start", action="store_true",
                      help="first search the twin (--model, --gpu or --device-profile, --max-model-len) under the "
                           "workload measured from Prometheus; try its best 3 first, before vLLM's defaults")
    live.add_argument("--warm-start-trials", type=int, default=20, help="twin trials of the warm start")
    live.add_argument("--signals-timeout", type=float, default=600.0, metavar="S",
                      help="give up when Prometheus has shown no usable signal for S seconds since the start "
                           "(a wrong URL, no scrape, no traffic); 0 waits forever (default %(default)s)")
    live.add_argument("--keep-running", action="store_true", help="leave the engine running at the end")
    live.add_argument("engine_command", nargs=argparse.REMAINDER, help="after --: the engine command")


def _register_tuner(subparsers: Any) -> None:
    """`kvpilot tuner`, the in-cluster tuner."""
    t = subparsers.add_parser(
        "tuner",
        help="run the in-cluster tuner for every InferenceService with spec.tuning.enabled",
        description=(
            "The in-cluster tuner: a process of its own (apart from the operator) that tunes every "
            "InferenceService with spec.tuning.enabled, one trial at a time per service, by patching "
            "only the tuned spec.engine fields (field manager kvpilot-tuner).  Writes status.tuning, an "
            "Event per trial, and serves its metrics on --metrics-port.  For every InferenceService with "
            "spec.autoscaling it also runs the replica planner: kvpilot_desired_replicas on --metrics-port, and "
            "for actor kvpilot spec.replicas through the scale subresource (field manager kvpilot-planner), "
            "an Event and the Scaling condition when the count or its reason changes."
        ),
    )
    t.add_argument("--prometheus", required=True, metavar="URL", help="the cluster's Prometheus")
    t.add_argument("--namespace", help="only this namespace (default: all)")
    t.add_argument("--storage", default=None, metavar="URL",
                   help=f"Optuna storage URL without a password (default: ${ENV_TUNER_STORAGE}, else "
                        f"{DEFAULT_TUNER_STORAGE}); a URL with a password belongs in ${ENV_TUNER_STORAGE}, "
                        "where no process listing shows it")
    t.add_argument("--metrics-port", type=int, default=9109, help="default %(default)s; 0 disables")
    t.add_argument("--resync", type=float, default=30.0, help="seconds between scans for services")
    t.add_argument("--poll", type=float, default=15.0, help="burn-rate poll interval, seconds")
    t.add_argument("--scrape-interval", type=_seconds, default=30.0, metavar="S",
                   help="seconds between the replica planner's reads of Prometheus for each InferenceService "
                        "with spec.autoscaling (default %(default)s; set it to Prometheus' scrape interval: its "
                        "rate windows span four reads)")
    t.set_defaults(handler=_tuner)


def _seconds(text: str) -> float:
    """An argparse type: a positive, finite number of seconds."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a number of seconds above 0")
    return v


def _setup_logging(verbose: bool = False) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _tune(args: argparse.Namespace) -> int:
    from kvpilot.tuner.iofailure import IOFailure, storage_failure
    from kvpilot.tuner.jobs import UsageError, tune_local, tune_offline
    from kvpilot.tuner.storage import redacted

    if args.engine_command and args.engine_command[0] == "--":
        args.engine_command = args.engine_command[1:]
    if args.trials < 1:
        print("kvpilot tune: --trials must be >= 1", file=sys.stderr)
        return 2
    if args.workers < 1 or (args.local and args.workers != 1):
        why = "is for --offline (a live study measures one engine)" if args.local else "must be >= 1"
        print(f"kvpilot tune: --workers {why}, got {args.workers}", file=sys.stderr)
        return 2
    if args.local and args.join:
        print("kvpilot tune: --join is for --offline (a live study measures one engine)", file=sys.stderr)
        return 2
    if args.heartbeat_interval < 1:
        print(f"kvpilot tune: --heartbeat-interval must be >= 1 second, got {args.heartbeat_interval}", file=sys.stderr)
        return 2
    if args.grace_period <= args.heartbeat_interval:
        print(f"kvpilot tune: --grace-period must be more than --heartbeat-interval ({args.heartbeat_interval}), "
              f"got {args.grace_period}", file=sys.stderr)
        return 2
    _setup_logging(verbose=bool(args.local))
    # Like the in-cluster tuner's: a PostgreSQL URL with its password stays out of /proc/PID/cmdline.
    if args.storage is None:
        args.storage = os.environ.get(ENV_TUNER_STORAGE) or DEFAULT_TUNE_STORAGE
    try:
        if args.local:
            return tune_local(args)
        if args.engine_command:
            raise UsageError("an engine command after -- needs --local")
        return tune_offline(args)
    except UsageError as exc:
        print(f"kvpilot tune: {exc}", file=sys.stderr)
        return 2
    except IOFailure as exc:
        print(f"kvpilot tune: {exc}", file=sys.stderr)
        return exc.exit_code
    except Exception as exc:
        # The study's storage failing (a full disk, a read-only file, a damaged one) is named as that;
        # what else comes here is bad input (a ValueError) or a bug.
        failure = storage_failure(exc, args.storage, redacted(args.storage))
        if failure is not None:
            print(f"kvpilot tune: {failure}", file=sys.stderr)
            return failure.exit_code
        if isinstance(exc, ValueError):
            print(f"kvpilot tune: {exc}", file=sys.stderr)
            return 2
        raise


def tuner_storage(args: argparse.Namespace, environ: dict[str, str] | None = None) -> str:
    """The in-cluster tuner's storage URL: --storage, else $KVPILOT_TUNER_STORAGE, else SQLite on the
    chart's volume.  A password on the command line is refused: every process that can read
    /proc/PID/cmdline (or `kubectl get pod -o yaml`, where the chart wrote args) would see it."""
    from kvpilot.tuner.storage import StorageError, has_password

    if args.storage is not None:
        if has_password(args.storage):
            raise StorageError(f"--storage carries a password, which the command line shows to every process "
                               f"that can list processes: pass the URL in ${ENV_TUNER_STORAGE} instead")
        return str(args.storage)
    env = os.environ if environ is None else environ
    return env.get(ENV_TUNER_STORAGE) or DEFAULT_TUNER_STORAGE


def _tuner(args: argparse.Namespace) -> int:
    _setup_logging(verbose=True)
    from kvpilot.tuner.incluster import run_tuner
    from kvpilot.tuner.kubeapi import KubeCredentialsError
    from kvpilot.tuner.storage import StorageError, check_storage_url

    try:
        flag = "--storage" if args.storage is not None else f"${ENV_TUNER_STORAGE}"
        args.storage = check_storage_url(tuner_storage(args), flag=flag)
        return run_tuner(args)
    except (KubeCredentialsError, StorageError) as exc:
        print(f"kvpilot tuner: {exc}", file=sys.stderr)
        return 2
