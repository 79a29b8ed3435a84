"""The start command of `make serve` and the CPU image (tools/serve.sh): the `vllm serve` line it builds from its
environment, and the image's use of it (install through `make setup`, as CI; the server as PID 1)."""
import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import load_benchmark

ROOT = Path(__file__).resolve().parents[1]
VENV = str(Path(sys.executable).parent.parent)


def _serve_args(**env) -> list[str]:
    base = {k: v for k, v in os.environ.items() if k not in ("MODEL", "HOST", "PORT", "DTYPE", "SERVE_ARGS",
                                                             "SERVED_MODEL_NAME", "SPECULATIVE_CONFIG", "MEM_UTIL")}
    p = subprocess.run([str(ROOT / "tools" / "serve.sh")], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=base | {"VENV": VENV, "ENTMTP_SERVE_DRY_RUN": "1"} | env)
    assert p.returncode == 0, p.stderr
    return p.stdout.splitlines()


def _opt(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_serve_script_defaults_serve_the_prepared_model_with_entmtp(default_model):
    args = _serve_args()
    assert args[:3] == [f"{VENV}/bin/vllm", "serve", str(default_model)]
    assert json.loads(_opt(args, "--speculative-config")) == {"method": "entmtp"}
    assert _opt(args, "--served-model-name") == "SmolLM2-135M-Instruct"
    assert (_opt(args, "--host"), _opt(args, "--port")) == ("127.0.0.1", "8000")
    # the dtype rule is the one benchmarks/compare.py serves with (float32 without AVX-512 BF16)
    load_benchmark("compare")
    from compare_server import default_dtype

    assert _opt(args, "--dtype") == default_dtype()


def test_serve_script_reads_its_environment():
    args = _serve_args(MODEL="/models/x", HOST="0.0.0.0", PORT="9001", DTYPE="bfloat16",
                       SPECULATIVE_CONFIG='{"method": "entmtp", "tree_set": "humaneval"}',
                       SERVE_ARGS="--max-num-seqs 16 --enforce-eager")
    assert args[2] == "/models/x" and "--served-model-name" not in args  # a user's model keeps its own name
    assert (_opt(args, "--host"), _opt(args, "--port"), _opt(args, "--dtype")) == ("0.0.0.0", "9001", "bfloat16")
    assert json.loads(_opt(args, "--speculative-config"))["tree_set"] == "humaneval"
    assert args[-3:] == ["--max-num-seqs", "16", "--enforce-eager"]


def test_the_cpu_image_installs_as_ci_does_and_runs_the_server_as_pid_1():
    lines = [ln.strip() for ln in (ROOT / "Dockerfile").read_text().splitlines() if ln and not ln.startswith("#")]
    assert any(ln.startswith("RUN make setup") for ln in lines)  # .ci/run -> make test -> make setup
    assert lines[-1] == 'CMD ["tools/serve.sh"]'  # exec form: no shell between Docker and the script
    script = (ROOT / "tools" / "serve.sh").read_text().rstrip().splitlines()
    assert script[-1] == 'exec "${cmd[@]}"'  # ... which replaces itself with `vllm serve`
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and "runs" in ignored  # a local .venv's stamp would make `make setup` skip the install
    assert 'VOLUME ["/cache"]' in lines and any("VLLM_CACHE_ROOT=/cache/vllm" in ln for ln in lines)
