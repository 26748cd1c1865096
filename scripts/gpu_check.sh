#!/usr/bin/env bash
# GPU validation of camp2p-overlap on one CUDA GPU, in under 8 minutes.
#
#   OUT=./out bash scripts/gpu_check.sh
#
# Writes under $OUT (default ./out):
#   gpu_check.json     summary: status (passed / failed / skipped), each part's
#                      exit code, duration and counts, the environment
#   env.txt            python, torch, CUDA, nvidia-smi
#   pytest_gpu.log     pytest -m gpu (tests/test_gpu_validation.py and every
#   pytest_gpu.xml     other gpu-marked test) and its JUnit XML
#   bench_cuda.json    camp2p-overlap bench --device cuda --scenario ffn-bound
#   bench_cuda.log
# Without a CUDA device it writes a "skipped" summary and exits 0.
# Exit status: 0 passed or skipped, 1 a part failed.
# Python: $PYTHON, else .venv/bin/python, else python3.
set -u
cd "$(dirname "$0")/.."
REPO=$PWD
OUT=${OUT:-./out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
if [[ -n "${PYTHON:-}" ]]; then
  PY=$PYTHON
elif [[ -x .venv/bin/python ]]; then
  PY=.venv/bin/python
else
  PY=python3
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}
unset TORCH_CUDA_SANITIZER  # the sanitizer runs only in the test that asks for it
T0=$(date +%s)
PYTEST_LIMIT=${PYTEST_LIMIT:-300}
BENCH_LIMIT=${BENCH_LIMIT:-120}

summary() {  # summary STATUS REASON [PYTEST_RC] [BENCH_RC] [PYTEST_S] [BENCH_S]
  STATUS=$1 REASON=$2 PYTEST_RC=${3:-} BENCH_RC=${4:-} PYTEST_S=${5:-} BENCH_S=${6:-} \
  T_TOTAL=$(($(date +%s) - T0)) OUT="$OUT" "$PY" - <<'PYEOF' || echo "{\"status\": \"$1\", \"reason\": \"$2\"}" >"$OUT/gpu_check.json"
import json, os, pathlib, xml.etree.ElementTree as ET
out = pathlib.Path(os.environ["OUT"])
def num(name):
    v = os.environ.get(name, "")
    return int(v) if v.lstrip("-").isdigit() else None
s = {
    "status": os.environ["STATUS"],
    "reason": os.environ["REASON"],
    "seconds": num("T_TOTAL"),
    "pytest": {"rc": num("PYTEST_RC"), "seconds": num("PYTEST_S"), "log": "pytest_gpu.log"},
    "bench": {"rc": num("BENCH_RC"), "seconds": num("BENCH_S"), "json": "bench_cuda.json", "log": "bench_cuda.log"},
}
xml = out / "pytest_gpu.xml"
if xml.exists():
    try:
        root = ET.parse(xml).getroot()
        suites = [root] if root.tag == "testsuite" else list(root)
        counts = {k: sum(int(x.get(k, 0)) for x in suites) for k in ("tests", "failures", "errors", "skipped")}
        counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
        s["pytest"]["counts"] = counts
        s["pytest"]["not_passed"] = [
            f"{c.get('classname')}::{c.get('name')}: {next(iter(c)).tag}"
            for x in suites for c in x.iter("testcase") if len(c)
        ]
    except Exception as exc:  # noqa: BLE001
        s["pytest"]["counts_error"] = repr(exc)
bj = out / "bench_cuda.json"
if bj.exists():
    try:
        b = json.loads(bj.read_text())
        s["bench"]["headline"] = {
            "device": b.get("device"),
            "scenario": b.get("scenario"),
            "outputs_equal": b.get("outputs_equal"),
            "policies": {
                p.get("policy"): {
                    "per_layer_us_median": (p.get("per_layer_us") or {}).get("median"),
                    "speedup": p.get("speedup"),
                    "eta": p.get("eta"),
                    "engaged": p.get("engaged"),
                    "outputs_equal": p.get("outputs_equal"),
                }
                for p in b.get("policies", [])
                if isinstance(p, dict)
            },
        }
    except Exception as exc:  # noqa: BLE001
        s["bench"]["json_error"] = repr(exc)
env = out / "env.txt"
if env.exists():
    s["env"] = env.read_text().strip().splitlines()[:12]
(out / "gpu_check.json").write_text(json.dumps(s, indent=1))
print(json.dumps({k: s[k] for k in ("status", "reason", "seconds")}))
PYEOF
}

# 1. Is there a CUDA device?
if ! "$PY" -c 'import torch' >"$OUT/env.txt" 2>&1; then
  summary skipped "torch is not importable with $PY"
  exit 0
fi
"$PY" - >"$OUT/env.txt" 2>&1 <<'PYEOF'
import platform, torch
print("python", platform.python_version())
print("torch", torch.__version__, "cuda", torch.version.cuda)
print("cuda available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", torch.cuda.get_device_name(0), "sm", f"{p.major}.{p.minor}", "SMs", p.multi_processor_count)
for mod in ("wrapt", "pytest", "vllm"):
    try:
        m = __import__(mod)
        print(mod, getattr(m, "__version__", "?"))
    except Exception as exc:  # noqa: BLE001
        print(mod, "not importable:", type(exc).__name__)
PYEOF
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >>"$OUT/env.txt" 2>&1 || true
fi
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  summary skipped "no CUDA device: torch.cuda.is_available() is False"
  exit 0
fi

# 2. pytest -m gpu (the gpu-marked tests of the whole suite)
t=$(date +%s)
if "$PY" -c 'import pytest' >/dev/null 2>&1; then
  timeout -k 10 "$PYTEST_LIMIT" "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider \
    --junitxml="$OUT/pytest_gpu.xml" tests >"$OUT/pytest_gpu.log" 2>&1
  pytest_rc=$?
else
  echo "pytest is not importable with $PY" >"$OUT/pytest_gpu.log"
  pytest_rc=127
fi
pytest_s=$(($(date +%s) - t))

# 3. the benchmark on the GPU, ffn-bound scenario
t=$(date +%s)
timeout -k 10 "$BENCH_LIMIT" "$PY" -m camp2p_overlap.tools.cli bench --device cuda --scenario ffn-bound \
  --json "$OUT/bench_cuda.json" >"$OUT/bench_cuda.log" 2>&1
bench_rc=$?
bench_s=$(($(date +%s) - t))

status=passed
reason="pytest -m gpu and the cuda benchmark passed"
if [[ $pytest_rc -ne 0 || $bench_rc -ne 0 ]]; then
  status=failed
  reason="pytest rc=$pytest_rc (124: time limit), bench rc=$bench_rc (124: time limit)"
fi
summary "$status" "$reason" "$pytest_rc" "$bench_rc" "$pytest_s" "$bench_s"
[[ $status == passed ]]
