"""The GPU check: what gpu_lab has never run on a GPU, checked in one go, in at most 8 minutes.

On the GPU machine (one H200; its image lacks some packages, which travel as wheels in .whl/,
made here by `make gpu-wheels`), with the device tool, from the repository root:

    command:   PYTHONUNBUFFERED=1 python3 bench/gpu_check.py --wheels .whl --out "$OUT"
    carry:     [".whl"]
    timeout_s: 480

It installs the wheels with pip --no-index into a folder of its own, runs each step (listed by
`--list`) in a process of its own, timed, within a budget (`--budget`, 420 s by default): a
failed, crashed or timed-out step is recorded and the next one runs. It writes
$OUT/gpu_check.json (every figure and check), $OUT/gpu_check.txt (the summary, also printed) and
$OUT/gpu_check.log (each step's output), rewriting the JSON after every step, so a run cut short
keeps what it finished. The machine is lent for 15 minutes of device time, its start included:
to rerun steps that failed, after a fix, add `--only <steps> --budget 150` (e.g. `--only
loader,telemetry`) to the same command, with timeout_s 210.

`make gpu-check` runs the same command (OUT defaults to gpu_check_out/). On a GPU, the check also
leaves gpu_check.json in GPU_LAB_HOME (default ~/.gpu_lab), where the tutorials' full-mode time
estimates read this machine's measured ResNet-50 throughput (gpu_lab/estimate.py).

The smoke lane of the tutorials (bench/gpu_notebook_steps.py) is the same runner with other steps:

    command:   PYTHONUNBUFFERED=1 python3 bench/gpu_check.py --lane notebooks --budget 240 \
               --wheels .whl --out "$OUT"        (make gpu-notebooks; gpu_notebooks.json/.txt/.log)
    timeout_s: 300

    python bench/gpu_check.py --dry-run      # on a CPU: imports everything, lists the steps,
                                             # checks .whl/ against bench/gpu_wheels.txt and runs
                                             # each step's CPU-safe part (tests/test_gpu_check.py)
    python bench/gpu_check.py --check-wheels .whl   # only the wheels (make gpu-wheels runs it)

Until the steps run, this file needs the standard library alone (and NVML through gpu_lab's
probe, which does without it): it starts on the bare image, before the wheels are installed.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
WHEEL_LIST = BENCH / "gpu_wheels.txt"
TRAVEL_LIMIT = 64 * 1024 ** 2        # what travels to the GPU machine: tree + carried wheels
DEFAULT_BUDGET = 420                 # seconds for the steps, inside the 8 minutes
MAX_MANYLINUX = 28                   # the newest glibc tag the download asks for


# ---------------------------------------------------------------------------------------- wheels

def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wanted_wheels(path: Path | None = None) -> dict[str, str]:
    """{normalised name: version} from bench/gpu_wheels.txt (`name==version` lines)."""
    out = {}
    for line in (path or WHEEL_LIST).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, ver = line.partition("==")
            out[_norm(name)] = ver.strip()
    return out


def _tag_ok(python: str, abi: str, plat: str) -> bool:
    """Installable by CPython 3.12 on manylinux x86_64 (the GPU image)."""
    pys = python.split(".")
    abis = abi.split(".")
    py_ok = any(p in ("py3", "cp312") or re.fullmatch(r"cp3(\d+)", p) and "abi3" in abis
                and int(p[3:]) <= 12 for p in pys)
    abi_ok = any(a in ("none", "abi3", "cp312") for a in abis)
    plat_ok = False
    for p in plat.split("."):
        m = re.fullmatch(r"manylinux_2_(\d+)_x86_64", p)
        plat_ok |= (p == "any" or p in ("manylinux1_x86_64", "manylinux2010_x86_64",
                                        "manylinux2014_x86_64")
                    or bool(m and int(m[1]) <= MAX_MANYLINUX))
    return bool(py_ok and abi_ok and plat_ok)


def tree_bytes() -> int | None:
    """The bytes of the working tree that travel with a device call (git's tracked and
    untracked-not-ignored files); None without git."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                              "--exclude-standard"], cwd=REPO, capture_output=True,
                             check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    total = 0
    for name in out.decode().split("\0"):
        p = REPO / name
        if name and p.is_file():
            total += p.stat().st_size
    return total


def check_wheels(folder: Path) -> dict:
    """What `folder` holds against bench/gpu_wheels.txt: one wheel per listed name, at the listed
    version, with tags CPython 3.12 on manylinux x86_64 installs; the size that travels."""
    want = wanted_wheels()
    problems: list[str] = []
    if not folder.is_dir():
        return {"folder": str(folder), "wanted": len(want), "wheels": [], "total_bytes": 0,
                "tree_bytes": None, "ok": False,
                "problems": [f"{folder} does not exist: run `make gpu-wheels`"]}
    files = sorted(folder.glob("*.whl"))
    found: dict[str, list] = {}
    rows = []
    for f in files:
        parts = f.name[:-4].split("-")
        if len(parts) not in (5, 6):
            problems.append(f"{f.name}: not a wheel file name")
            continue
        name, ver, (py, abi, plat) = _norm(parts[0]), parts[1], parts[-3:]
        found.setdefault(name, []).append(f.name)
        ok = _tag_ok(py, abi, plat)
        rows.append({"file": f.name, "bytes": f.stat().st_size, "tags_ok": ok})
        if not ok:
            problems.append(f"{f.name}: tags {py}-{abi}-{plat} are not for CPython 3.12 on "
                            f"manylinux x86_64")
        if name not in want:
            problems.append(f"{f.name}: not in {WHEEL_LIST.name} (remove it: pip refuses two "
                            f"versions, and it travels for nothing)")
        elif want[name] != ver:
            problems.append(f"{f.name}: version {ver}, {WHEEL_LIST.name} wants {want[name]}")
    for name in want:
        if name not in found:
            problems.append(f"{name}=={want[name]} missing from {folder}: run `make gpu-wheels`")
        elif len(found[name]) > 1:
            problems.append(f"{name}: {len(found[name])} wheels ({', '.join(found[name])}); "
                            f"keep one")
    total = sum(r["bytes"] for r in rows)
    tree = tree_bytes()
    if tree is not None and total + tree > TRAVEL_LIMIT:
        problems.append(f"wheels {total / 2**20:.1f} MiB + tree {tree / 2**20:.1f} MiB exceed the "
                        f"{TRAVEL_LIMIT / 2**20:.0f} MiB that travel")
    return {"folder": str(folder), "wanted": len(want), "wheels": rows, "total_bytes": total,
            "tree_bytes": tree, "problems": problems, "ok": not problems}


def wheels_line(w: dict) -> str:
    tree = f" + tree {w['tree_bytes'] / 2**20:.1f} MiB" if w["tree_bytes"] is not None else ""
    return (f"{len(w['wheels'])} wheels of {w['wanted']} listed, {w['total_bytes'] / 2**20:.1f} MiB"
            f"{tree} (limit {TRAVEL_LIMIT / 2**20:.0f} MiB)"
            + "".join(f"\n  problem: {p}" for p in w["problems"]))


def wheels_table(w: dict) -> str:
    rows = [f"  {r['bytes'] / 1024:9,.0f} KiB  {r['file']}" + ("" if r["tags_ok"] else "  BAD TAGS")
            for r in w["wheels"]]
    return "\n".join(rows + ["  " + wheels_line(w)])


def install_wheels(folder: Path, site: Path) -> dict:
    """pip install --no-index every wheel of `folder` into `site` (the GPU machine is offline)."""
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
           "--no-cache-dir", "--disable-pip-version-check", "--target", str(site),
           *map(str, sorted(folder.glob("*.whl")))]
    out = subprocess.run(cmd, capture_output=True, text=True)
    return {"ok": out.returncode == 0, "seconds": round(time.perf_counter() - t0, 1),
            "output": (out.stdout + out.stderr)[-3000:]}


# ----------------------------------------------------------------------------------- processes

def _become_subreaper() -> None:
    """Orphans of a step (a supervisor it launched, a kernel) become this process's children, so
    nothing a step started outlives it and holds the GPU for the next step."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def _end_descendants() -> list[int]:
    """SIGKILL every process this one started and that still runs; their pids."""
    import psutil

    procs = psutil.Process().children(recursive=True)
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)
    return [p.pid for p in procs]


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


# ----------------------------------------------------------------------------------- the steps

LANES = {"check": None, "notebooks": str(BENCH / "gpu_notebook_steps.py")}


def load_steps(path: str | None) -> list:
    """The steps: gpu_check_steps.STEPS, or STEPS of another file (a lane's, or `--steps-file`
    for tests of this runner)."""
    if path is None:
        import gpu_check_steps

        return gpu_check_steps.STEPS
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check_other_steps", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.STEPS


def run_step(args: argparse.Namespace) -> int:
    """In the step's own process: run it, write its result file, exit at once."""
    import traceback

    from gpu_check_steps import Ctx

    step = {s.name: s for s in load_steps(args.steps_file)}[args.step]
    ctx = Ctx(dry=args.dry_run, work=Path(args.work))
    error = None
    try:
        step.run(ctx)
    except BaseException as e:  # noqa: BLE001 - the runner records every way a step ends
        error = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    status = "error" if error else ("fail" if any(not c["ok"] for c in ctx.checks) else "pass")
    Path(args.result).write_text(json.dumps({"status": status, "summary": ctx.line,
                                             "checks": ctx.checks, "results": ctx.results,
                                             "error": error}, default=str, indent=1))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # threads and kernels a step left behind must not hold the exit


def _tail(path: Path, start: int, limit: int = 4000) -> str:
    with open(path, "rb") as f:
        f.seek(max(start, path.stat().st_size - limit))
        return f.read().decode(errors="replace")


class Runner:
    def __init__(self, args: argparse.Namespace, steps: list, out: Path, work: Path,
                 env: dict[str, str]) -> None:
        self.args, self.steps, self.out, self.work, self.env = args, steps, out, work, env
        self.stem = stem(args)
        self.log = out / f"{self.stem}.log"
        self.t0 = time.monotonic()
        self.report: dict = {
            "schema": 1, "mode": "dry-run" if args.dry_run else "gpu", "lane": args.lane,
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host": {"hostname": platform.node(), "python": platform.python_version(),
                     "cpus": os.cpu_count()},
            "budget_s": args.budget, "steps": []}

    def save(self) -> None:
        self.report["elapsed_s"] = round(time.monotonic() - self.t0, 1)
        tmp = self.out / f"{self.stem}.json.tmp"
        tmp.write_text(json.dumps(self.report, indent=1, default=str))
        tmp.replace(self.out / f"{self.stem}.json")

    def one(self, step) -> dict:
        left = self.args.budget - (time.monotonic() - self.t0)
        entry = {"name": step.name, "title": step.title if not self.args.dry_run else
                 f"{step.title} — CPU part: {step.cpu_part}", "status": "not run", "seconds": 0.0,
                 "summary": "", "checks": [], "results": {}, "error": None}
        if self.args.only and step.name not in self.args.only:
            entry["summary"] = "not selected (--only)"
            return entry
        if left < 20:
            entry["summary"] = (f"not run: {max(left, 0):.0f} s of the {self.args.budget} s "
                                f"budget left")
            return entry
        # this CPU is slower than the GPU machine's: the dry run gives a step four times its cap
        timeout = min(step.cap_s * (4 if self.args.dry_run else 1), left)
        work = self.work / step.name
        (work / "tmp").mkdir(parents=True, exist_ok=True)
        result = work / "result.json"
        env = dict(self.env, TMPDIR=str(work / "tmp"), JUPYTER_RUNTIME_DIR=str(work / "jupyter"))
        with open(self.log, "a") as log:
            log.write(f"\n===== {step.name}: {step.title} (timeout {timeout:.0f} s)\n")
            log.flush()
            start = log.tell()
            cmd = [sys.executable, str(Path(__file__).resolve()), "--step", step.name,
                   "--work", str(work), "--result", str(result)]
            if self.args.dry_run:
                cmd.append("--dry-run")
            if self.args.steps_file:
                cmd += ["--steps-file", self.args.steps_file]
            elif self.args.lane != "check":
                cmd += ["--lane", self.args.lane]
            print(f"[{time.monotonic() - self.t0:6.1f} s] {step.name} ...", flush=True)
            t0 = time.monotonic()
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = None
            entry["seconds"] = round(time.monotonic() - t0, 1)
        left_over = _end_descendants()
        _reap()
        if result.exists():
            entry.update(json.loads(result.read_text()))
        elif rc is None:
            entry.update(status="timeout", error=f"no result after {timeout:.0f} s")
        else:
            entry.update(status="crashed", error=f"exited {rc} without a result")
        if rc is None and entry["status"] != "timeout":
            entry["status"] = "timeout"
            entry["error"] = f"ended at {timeout:.0f} s, after writing its result"
        if left_over:
            entry["left_over_processes"] = len(left_over)
        if entry["status"] != "pass":
            entry["log_tail"] = _tail(self.log, start)
        print(f"[{time.monotonic() - self.t0:6.1f} s] {step.name} {entry['status']} "
              f"({entry['seconds']} s) {entry['summary'] or entry['error'] or ''}", flush=True)
        return entry

    def run(self) -> dict:
        self.save()
        for step in self.steps:
            self.report["steps"].append(self.one(step))
            self.save()
        steps = self.report["steps"]
        self.report["passed"] = [s["name"] for s in steps if s["status"] == "pass"]
        self.report["failed"] = [s["name"] for s in steps if s["status"] not in ("pass", "not run")]
        self.report["not_run"] = [s["name"] for s in steps if s["status"] == "not run"]
        self.save()
        return self.report


def stem(args: argparse.Namespace) -> str:
    """The report's file names: gpu_check.*, or gpu_<lane>.* for another lane."""
    return "gpu_check" if args.lane == "check" else f"gpu_{args.lane}"


def keep_for_estimates(report: dict, home: str | None) -> Path | None:
    """On a GPU, a check that measured ResNet-50's throughput leaves its report where the
    tutorials' full-mode estimates look (GPU_LAB_HOME, default ~/.gpu_lab)."""
    train = next((s for s in report["steps"] if s["name"] == "gpu_train"), None)
    if report["mode"] != "gpu" or not train or train["status"] != "pass":
        return None
    folder = Path(home or Path.home() / ".gpu_lab")
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = folder / "gpu_check.json"
    path.write_text(json.dumps(report, indent=1, default=str))
    path.chmod(0o600)
    return path


def summary_text(report: dict) -> str:
    gpu = next((s["results"].get("gpu") for s in report["steps"] if s["name"] == "environment"),
               None)
    what = "GPU check" if report.get("lane", "check") == "check" else f"{report['lane']} lane"
    lines = [f"gpu_lab {what} ({report['mode']}) on {report['host']['hostname']}"
             + (f", {gpu}" if gpu else "") + f", {report['started']}: {report['elapsed_s']:.0f} s "
             f"of a {report['budget_s']} s budget"]
    if report.get("wheels"):
        w = report["wheels"]
        lines.append(f"  wheels: {'ok' if w.get('ok') else 'PROBLEMS'}"
                     + (f", installed in {w['install']['seconds']} s" if w.get("install") else ""))
    for s in report["steps"]:
        lines.append(f"  {s['name']:<13} {s['status']:<8} {s['seconds']:6.1f} s  "
                     f"{s['summary'] or s['error'] or ''}")
        lines += [f"      failed check: {c['name']}: {c['detail'][:300]}" for c in s["checks"]
                  if not c["ok"]]
    lines.append(f"result: {len(report.get('passed', []))} passed, failed: "
                 f"{', '.join(report.get('failed', [])) or 'none'}, not run: "
                 f"{', '.join(report.get('not_run', [])) or 'none'}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true",
                    help="on a CPU: import everything, list the steps, check the wheels, run each "
                         "step's CPU-safe part")
    ap.add_argument("--wheels", default=".whl",
                    help="the folder of wheels the GPU image lacks (default .whl; make gpu-wheels)")
    ap.add_argument("--no-install", action="store_true",
                    help="use the packages already importable instead of installing --wheels")
    ap.add_argument("--out", default=None,
                    help="where gpu_check.json/.txt/.log go (default $OUT, else gpu_check_out)")
    ap.add_argument("--budget", type=int, default=None,
                    help=f"seconds for all steps (default {DEFAULT_BUDGET} on the GPU, 900 dry)")
    ap.add_argument("--only", default="", help="comma list of steps to run (the rest: not run)")
    ap.add_argument("--lane", choices=sorted(LANES), default="check",
                    help="check: the GPU check (default); notebooks: the tutorials' smoke lane")
    ap.add_argument("--list", action="store_true", help="list the steps and exit")
    ap.add_argument("--check-wheels", metavar="DIR", help="only check a wheels folder and exit")
    ap.add_argument("--step", help=argparse.SUPPRESS)      # internal: one step, in its process
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--steps-file", help=argparse.SUPPRESS)  # tests: other steps, same runner
    args = ap.parse_args(argv)

    if args.lane != "check" and not args.steps_file:
        args.steps_file = LANES[args.lane]
        if args.dry_run:
            os.environ["GPU_LAB_LANE_DRY"] = "1"  # the lane lists every shape on a CPU
    if args.step:
        return run_step(args)
    if args.check_wheels:
        w = check_wheels(Path(args.check_wheels))
        print(wheels_table(w))
        return 0 if w["ok"] else 1

    steps = load_steps(args.steps_file)
    names = [s.name for s in steps]
    args.only = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in args.only if n not in names]
    if unknown:
        ap.error(f"--only: unknown step(s) {', '.join(unknown)}; the steps: {', '.join(names)}")
    sys.path.insert(0, str(REPO))
    from gpu_lab.telemetry.probe import gpu_count

    if not args.dry_run and not args.list and gpu_count() == 0:
        # what `make bench` sees on a CPU: it says so and measures nothing
        print("gpu_check: no GPU visible (NVML sees none): nothing checked. `--dry-run` runs each "
              "step's CPU-safe part.", flush=True)
        return 0
    if args.list or args.dry_run:
        print("steps (GPU; CPU part in the dry run):")
        for s in steps:
            print(f"  {s.name:<13} {s.cap_s:4d} s  {s.title}\n  {'':<13}         CPU: {s.cpu_part}")
        if args.list:
            return 0
    if args.budget is None:
        args.budget = 900 if args.dry_run else DEFAULT_BUDGET

    out = Path(args.out or os.environ.get("OUT") or "gpu_check_out")
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem(args)}.log").write_text("")
    user_home = os.environ.get("GPU_LAB_HOME")
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    env = dict(os.environ, PYTHONUNBUFFERED="1", GPU_LAB_HOME=str(work / "gpu_lab_home"),
               MPLBACKEND="Agg")
    paths = [str(REPO)]
    wheels = check_wheels(Path(args.wheels))
    if args.dry_run:
        env["GPU_LAB_QUICK"] = "1"
    else:
        env.pop("GPU_LAB_QUICK", None)  # full sizes on the GPU
        if not args.no_install:
            site = work / "site"
            wheels["install"] = install_wheels(Path(args.wheels), site)
            paths.insert(0, str(site))
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [os.environ.get("PYTHONPATH")] if p])
    print(f"wheels: {wheels_line(wheels)}", flush=True)

    _become_subreaper()
    runner = Runner(args, steps, out, work, env)
    runner.report["wheels"] = wheels
    try:
        report = runner.run()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = summary_text(report)
    (out / f"{stem(args)}.txt").write_text(text + "\n")
    print(text)
    kept = keep_for_estimates(report, user_home)
    if kept:
        print(f"the measured throughput is kept for the tutorials' estimates: {kept}")
    install_ok = wheels.get("install", {}).get("ok", True)
    return 0 if not report["failed"] and wheels["ok"] and install_ok else 1


if __name__ == "__main__":
    sys.exit(main())
