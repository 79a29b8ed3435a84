"""One ``vllm serve`` per method, as ``make serve`` starts it: the command line, the :class:`Server` that starts it
in a process group of its own, waits for ``/health`` and always stops the whole group, and the helpers that read
its processes from ``/proc`` (group members, peak memory, environment) and its log (OpenMP binding)."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from compare_methods import SERVED_MODEL_NAME, Method
from throughput import BenchmarkError

HOST = "127.0.0.1"
MEM_UTIL = "0.5"  # tools/serve.sh: vLLM's CPU start-up check of free memory fails at its default 0.92
#: as tools/serve.sh, and vLLM's development endpoints (``POST /reset_prefix_cache``: the benchmark empties the
#: prefix cache before every level; the servers listen on localhost only)
SERVER_ENV_DEFAULTS = {"VLLM_CPU_KVCACHE_SPACE": "4", "HF_HUB_OFFLINE": "1", "VLLM_SERVER_DEV_MODE": "1"}
LOG_TAIL_LINES = 40


def default_dtype(cpuinfo: str = "/proc/cpuinfo") -> str:
    """``float32`` on a CPU without AVX-512 BF16 (bfloat16 linear layers run row by row there, so verifying
    draft tokens gets no batching benefit), else ``auto`` -- what ``make serve`` (``tools/serve.sh``) passes."""
    try:
        return "auto" if "avx512_bf16" in Path(cpuinfo).read_text() else "float32"
    except OSError:
        return "auto"


def port_in_use(port: int, host: str = HOST) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def vllm_executable() -> str:
    """``vllm`` beside this interpreter (the venv's), else the one on PATH."""
    here = Path(sys.executable).parent / "vllm"
    found = str(here) if here.is_file() else shutil.which("vllm")
    if not found:
        raise BenchmarkError("no `vllm` command beside this Python or on PATH (run `make setup`)")
    return found


def serve_command(vllm: str, model: str, method: Method, port: int, enforce_eager: bool = False,
                  extra: list[str] = ()) -> list[str]:
    """``vllm serve`` as ``make serve`` starts it, with ``method``'s ``--speculative-config``."""
    cmd = [vllm, "serve", model, "--served-model-name", SERVED_MODEL_NAME, "--host", HOST, "--port", str(port),
           "--gpu-memory-utilization", MEM_UTIL]
    if method.spec is not None:
        cmd += ["--speculative-config", json.dumps(method.spec)]
    if enforce_eager:
        cmd.append("--enforce-eager")
    extra = list(extra)
    if method.dtype is not None:  # the method's own dtype replaces the run's
        while "--dtype" in extra:
            i = extra.index("--dtype")
            del extra[i:i + 2]
        extra = [a for a in extra if not a.startswith("--dtype=")] + ["--dtype", method.dtype]
    return cmd + extra


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join("    " + ln for ln in text[-lines:])


def group_members(pgid: int) -> list[int]:
    """Pids of the live (not zombie) processes of process group ``pgid``, from ``/proc``."""
    pids = []
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat_file.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state ppid pgrp ...
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            pids.append(int(stat_file.parent.name))
    return pids


def portable(text: str) -> str:
    """``text`` with this checkout's folder (the working folder) left out of paths and the home folder written
    ``~``: results that get committed or shared do not name this machine's layout."""
    return text.replace(str(Path.cwd()) + os.sep, "").replace(str(Path.home()) + os.sep, "~" + os.sep)


def peak_rss_mib(pids: list[int]) -> float | None:
    """Sum over ``pids`` of each process's peak resident set (``VmHWM`` in ``/proc/<pid>/status``), MiB; None when
    none can be read. The processes may peak at different times, so this bounds the group's peak from above."""
    total, seen = 0, False
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1])  # kB
                    seen = True
                    break
        except (OSError, ValueError, IndexError):
            continue
    return total / 1024 if seen else None


#: Environment variables of the server's processes that decide how the CPU runs the model, recorded per run.
RUNTIME_ENV = ("LD_PRELOAD", "OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU",
               "VLLM_CPU_KVCACHE_SPACE")


def process_env(pids: list[int], keys=RUNTIME_ENV) -> dict[str, list[str]]:
    """``{key: sorted distinct values}`` of the environment variables ``keys`` over processes ``pids`` (from
    ``/proc/<pid>/environ``; vLLM-CPU sets ``LD_PRELOAD`` in its own processes, so the server's children are
    where it shows). Unreadable processes are skipped."""
    seen: dict[str, set[str]] = {}
    for pid in pids:
        try:
            raw = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        for item in raw.split(b"\0"):
            k, sep, v = item.decode(errors="replace").partition("=")
            if sep and k in keys:
                seen.setdefault(k, set()).add(v)
    return {k: sorted(v) for k, v in sorted(seen.items())}


def omp_binding(log: Path) -> list[str]:
    """The "OpenMP thread binding info" block vLLM-CPU's engine logs at start-up (which cores its worker's
    OpenMP threads are bound to), one string per line, without the log prefixes; [] when absent."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return []
    out: list[str] = []
    for i, line in enumerate(lines):
        if "OpenMP thread binding info" in line:
            prefix = line.split("OpenMP thread binding info")[0]
            for nxt in lines[i + 1:]:
                if not nxt.startswith(prefix):
                    break
                out.append(nxt[len(prefix):].strip())
            break
    return out


class Server:
    """One ``vllm serve`` in a process group of its own; ``with Server(...) as s:`` starts it, waits for
    ``/health`` and always stops it (the whole group) and waits for the port to be free again."""

    def __init__(self, cmd: list[str], log: Path, port: int, startup_timeout: float, name: str):
        self.cmd, self.log, self.port, self.timeout, self.name = cmd, log, port, startup_timeout, name
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def __enter__(self) -> Server:
        if port_in_use(self.port):
            raise BenchmarkError(f"port {self.port} is already in use; stop what listens there or pass --port")
        self.log.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        for k, v in SERVER_ENV_DEFAULTS.items():
            env.setdefault(k, v)
        env.pop("VLLM_ENTMTP_STATS_DIR", None)  # each server publishes its tree counters to a folder of its own
        t0 = time.monotonic()
        with open(self.log, "w") as logf:
            logf.write("$ " + shlex.join(self.cmd) + "\n")
            logf.flush()
            self.proc = subprocess.Popen(self.cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, start_new_session=True)
        try:
            self._wait_healthy(t0)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_healthy(self, t0: float) -> None:
        while True:
            code = self.proc.poll()
            if code is not None:
                raise BenchmarkError(f"the server for method {self.name} exited with code {code} during start-up; "
                                     f"log {self.log}, last lines:\n{log_tail(self.log)}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() - t0 > self.timeout:
                raise BenchmarkError(f"the server for method {self.name} was not healthy after {self.timeout:.0f} s "
                                     f"(--startup-timeout); log {self.log}, last lines:\n{log_tail(self.log)}")
            time.sleep(2)

    def runtime(self) -> dict:
        """How this server's processes run the model on the CPU: ``{"env": process_env(...), "omp_binding":
        [...]}``."""
        return {"env": process_env(group_members(self.proc.pid)), "omp_binding": omp_binding(self.log)}

    def peak_rss_mib(self) -> float | None:
        """Peak resident memory of the server so far (API server, engine core, workers: its process group), MiB;
        :func:`peak_rss_mib`."""
        return peak_rss_mib(group_members(self.proc.pid))

    def _wait_group(self, timeout: float) -> bool:
        """Waits up to ``timeout`` s for every live (not zombie) process of the server's group to exit."""
        deadline = time.monotonic() + timeout
        while group_members(self.proc.pid):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.5)
        return True

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)  # start_new_session: the group id is the server's pid
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, grace_s: float = 60.0, port_wait_s: float = 60.0) -> None:
        if self.proc is None:
            return
        self._signal(signal.SIGTERM)  # vLLM shuts its engine core down on SIGTERM
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        if not self._wait_group(10.0):
            self._signal(signal.SIGKILL)  # stragglers of the group (engine core, workers), or a hung server
            self._wait_group(10.0)
        self.proc.wait()
        try:  # the log names this machine's folders on almost every line
            self.log.write_text(portable(self.log.read_text(errors="replace")))
        except OSError:
            pass
        deadline = time.monotonic() + port_wait_s
        while port_in_use(self.port):
            if time.monotonic() > deadline:
                raise BenchmarkError(f"port {self.port} still in use {port_wait_s:.0f} s after stopping the server "
                                     f"for method {self.name}")
            time.sleep(1)
        self.proc = None
