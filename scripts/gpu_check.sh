#!/usr/bin/env bash
# GPU validation of camp2p-overlap on one CUDA GPU, in under 8 minutes.
#
#   OUT=./out bash scripts/gpu_check.sh
#
# Made for a GPU box with no network and no vLLM (Python 3.12, a CUDA torch,
# an unknown wrapt). Set-up, offline:
#   * wheels carried in $WHEELS (default ./.whl: wrapt>=2.5, and setuptools
#     if the box's is older than 77; scripts/gpu_wheels.sh fetches both) are
#     installed with --target into $SITE (default /tmp/camp2p-site), which goes
#     first on PYTHONPATH;
#   * the project is installed with pip install --no-deps --no-build-isolation
#     --no-index -e . ; if that fails the checkout is used through PYTHONPATH
#     and the summary says so. Either way the patch manifests are read as the
#     package camp2p_overlap.patches, the checkout's link to ./patches.
# Then, each part within what is left of $GPU_CHECK_BUDGET_S (default 450 s):
#   1. pytest -m gpu on the test files with gpu-marked tests (bitwise, device trace, the attention peer on the
#      device, SMs held by comm kernels, the stream sanitizer, tensor ownership,
#      CUDA graph capture incl. VLLM_CAMP2P_MULTISTREAM_GRAPH=1)   limit 240 s
#   2. camp2p-overlap bench --device cuda --scenario gpu-ffn-bound --comm-cores 8  limit 60 s
#   3. camp2p-overlap sweep --device cuda (ratios, --comm-cores points)       limit 110 s
#   4. camp2p-overlap overhead --ab-rounds 20 --json $OUT/overhead.json       limit 40 s
#      (host cost per (layer, stage) and per pass-through step; the decided-serial A/B
#      in 20 rounds, OVERHEAD_AB_ROUNDS overrides)
# Files under $OUT (8, the most a device run hands back):
#   gpu_check.json  summary: status (passed / failed / skipped), reason, the
#                   set-up, each part's exit code, time, limit and headline
#   env.txt         nvidia-smi, python, torch, CUDA, wrapt, pytest
#   pytest_gpu.xml  JUnit XML of part 1;  pytest_gpu.log its output
#   bench_cuda.json sweep_cuda.json overhead.json   parts 2-4 (--json)
#   tools.log       set-up output and the output of parts 2-4
# Exit status: 0 passed, or skipped where nvidia-smi sees no GPU; 1 failed,
# including when nvidia-smi sees a GPU but torch cannot use it.
# Python: $PYTHON, else the first of .venv/bin/python and python3 that imports torch.
set -u
cd "$(dirname "$0")/.."
REPO=$PWD
OUT=${OUT:-./out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WHEELS=${WHEELS:-$REPO/.whl}
SITE=${SITE:-/tmp/camp2p-site}
BUDGET_S=${GPU_CHECK_BUDGET_S:-450}
T0=$(date +%s)
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}
export PYTHONUNBUFFERED=1
unset TORCH_CUDA_SANITIZER  # the sanitizer runs only in the tests that ask for it
for v in $(env | grep -o '^VLLM_CAMP2P_[A-Z_]*'); do unset "$v"; done
: >"$OUT/tools.log"
: >"$OUT/env.txt"
# Results of each step, read by the summary.
declare -A R=()

note() { echo "== $*" >>"$OUT/tools.log"; }

summary() {  # summary STATUS REASON
  local py=${PY:-python3}
  command -v "$py" >/dev/null 2>&1 || py=python3
  local kv=()
  for k in "${!R[@]}"; do kv+=("$k=${R[$k]}"); done
  STATUS=$1 REASON=$2 T_TOTAL=$(($(date +%s) - T0)) BUDGET_S=$BUDGET_S OUT="$OUT" \
    "$py" - "${kv[@]}" <<'PYEOF' || printf '{"status": "%s", "reason": "%s"}\n' "$1" "$2" >"$OUT/gpu_check.json"
import json, os, pathlib, sys, xml.etree.ElementTree as ET
out = pathlib.Path(os.environ["OUT"])
r = dict(a.split("=", 1) for a in sys.argv[1:])
def num(v):
    return int(v) if v is not None and v.lstrip("-").isdigit() else v
def part(name, file=None):
    p = {k[len(name) + 1:]: num(v) for k, v in r.items() if k.startswith(name + ".")}
    if file:
        p["file"] = file
    return p
s = {
    "status": os.environ["STATUS"],
    "reason": os.environ["REASON"],
    "seconds": int(os.environ["T_TOTAL"]),
    "budget_s": int(os.environ["BUDGET_S"]),
    "gpu_seen_by_nvidia_smi": r.get("gpu_seen") == "1",
    "python": r.get("python"),
    "setup": part("setup"),
    "parts": {
        "pytest": part("pytest", "pytest_gpu.xml"),
        "bench": part("bench", "bench_cuda.json"),
        "sweep": part("sweep", "sweep_cuda.json"),
        "overhead": part("overhead", "overhead.json"),
    },
}
xml = out / "pytest_gpu.xml"
if xml.exists():
    try:
        root = ET.parse(xml).getroot()
        suites = [root] if root.tag == "testsuite" else list(root)
        counts = {k: sum(int(x.get(k, 0)) for x in suites) for k in ("tests", "failures", "errors", "skipped")}
        counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
        s["parts"]["pytest"]["counts"] = counts
        s["parts"]["pytest"]["not_passed"] = [
            f"{c.get('classname')}::{c.get('name')}: {next(iter(c)).tag}: {(next(iter(c)).get('message') or '')[:300]}"
            for x in suites for c in x.iter("testcase") if len(c)
        ]
    except Exception as exc:  # noqa: BLE001
        s["parts"]["pytest"]["counts_error"] = repr(exc)
def headline(b):
    return {
        "device": b.get("device"),
        "comm_model": b.get("comm_model"),
        "attn_modeled": b.get("attn_modeled"),
        "outputs_equal": b.get("outputs_equal"),
        "ffn_bound": (b.get("measured") or {}).get("ffn_bound"),
        "floor_per_layer_us": (b.get("measured") or {}).get("floor_per_layer_us"),
        "policies": {
            p.get("policy"): {
                "per_layer_us_median": (p.get("per_layer_us") or {}).get("median"),
                "speedup": p.get("speedup"),
                "eta": p.get("eta"),
                "engaged": p.get("engaged"),
                "outputs_equal": p.get("outputs_equal"),
                "peer_cycle_ok": p.get("peer_cycle_ok"),
            }
            for p in b.get("policies", []) if isinstance(p, dict)
        },
    }
for name, file in (("bench", "bench_cuda.json"), ("sweep", "sweep_cuda.json"), ("overhead", "overhead.json")):
    f = out / file
    if not f.exists():
        continue
    try:
        data = json.loads(f.read_text())
    except Exception as exc:  # noqa: BLE001
        s["parts"][name]["json_error"] = repr(exc)
        continue
    if name == "bench":
        s["parts"][name]["headline"] = headline(data)
    elif name == "sweep":
        s["parts"][name]["points"] = [
            {"kind": key, **{k: pt.get(k) for k in ("target_ratio", "measured_ratio", "stages", "comm_cores")
                             if k in pt}, "headline": headline(pt["report"])}
            for key in ("ratio_points", "stage_points", "comm_core_points") for pt in data.get(key, [])
        ]
    else:
        s["parts"][name]["result"] = {k: v for k, v in data.items() if not isinstance(v, (list, dict)) or k in (
            "engaged_us_per_layer_stage", "passthrough_us_per_step", "passthrough_us_per_call")}
        ab = data.get("decided_serial_ab")
        if isinstance(ab, dict):
            s["parts"][name]["result"]["decided_serial_ab"] = {k: v for k, v in ab.items() if k != "per_round"}
env = out / "env.txt"
if env.exists():
    s["env"] = env.read_text().strip().splitlines()[:20]
(out / "gpu_check.json").write_text(json.dumps(s, indent=1))
print(json.dumps({k: s[k] for k in ("status", "reason", "seconds")}))
PYEOF
}

finish() {  # finish STATUS REASON: write the summary and exit with the status's code
  summary "$1" "$2"
  [[ $1 == failed ]] && exit 1
  exit 0
}

# 0. Does nvidia-smi see a GPU? (Then a missing or CPU-only torch is a failure, not a skip.)
gpu_seen=0
if command -v nvidia-smi >/dev/null 2>&1; then
  smi=$(nvidia-smi -L 2>&1)
  echo "nvidia-smi -L: $smi" >>"$OUT/env.txt"
  grep -q '^GPU [0-9]' <<<"$smi" && gpu_seen=1
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv \
    >>"$OUT/env.txt" 2>&1 || true
else
  echo "nvidia-smi: not found" >>"$OUT/env.txt"
fi
R[gpu_seen]=$gpu_seen
no_gpu_or_fail() {  # no_gpu_or_fail WHY
  if [[ $gpu_seen == 1 ]]; then
    finish failed "nvidia-smi sees a GPU, but $1"
  fi
  finish skipped "no CUDA device: $1 (and nvidia-smi sees no GPU)"
}

# 1. The Python to use: one that imports torch.
PY=
if [[ -n "${PYTHON:-}" ]]; then
  cands=("$PYTHON")
else
  cands=(.venv/bin/python python3)
fi
for c in "${cands[@]}"; do
  if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import torch' >/dev/null 2>&1; then
    PY=$c
    break
  fi
done
R[python]=${PY:-none}
if [[ -z $PY ]]; then
  PY=python3
  no_gpu_or_fail "no Python here imports torch (tried: ${cands[*]})"
fi

# 2. Set-up, offline: carried wheels, wrapt, the project itself.
shopt -s nullglob
wheels=("$WHEELS"/*.whl)
shopt -u nullglob
R[setup.wheels]=${#wheels[@]}
if ((${#wheels[@]})); then
  note "pip install --target $SITE ${wheels[*]}"
  if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "${wheels[@]}" >>"$OUT/tools.log" 2>&1; then
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    R[setup.site]=$SITE
  else
    finish failed "installing the carried wheels from $WHEELS failed (see tools.log)"
  fi
fi
wrapt_v=$("$PY" -c 'import wrapt; print(wrapt.__version__)' 2>/dev/null || echo none)
R[setup.wrapt]=$wrapt_v
if ! "$PY" -c 'import sys, wrapt; v = tuple(int(x) for x in wrapt.__version__.split(".")[:2]); sys.exit(v < (2, 5))' \
  >/dev/null 2>&1; then
  finish failed "wrapt>=2.5 is needed, found $wrapt_v: carry its wheel in $WHEELS (scripts/gpu_wheels.sh)"
fi
note "pip install --no-deps --no-build-isolation --no-index -e ."
if "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . >>"$OUT/tools.log" 2>&1; then
  R[setup.install]=editable
else
  R[setup.install]="failed, using PYTHONPATH=$REPO"
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" - >>"$OUT/tools.log" 2>&1 <<'PYEOF'; then
import camp2p_overlap
from camp2p_overlap.core.patching.manifest import load_manifests
print("camp2p_overlap", camp2p_overlap.__version__, "from", camp2p_overlap.__file__)
print("manifests", [m.name for m in load_manifests()])
PYEOF
  finish failed "camp2p_overlap or its patch manifests do not import after set-up (see tools.log)"
fi
R[setup.import]=ok

"$PY" - >>"$OUT/env.txt" 2>&1 <<'PYEOF'
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
print("cuda available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", torch.cuda.get_device_name(0), "sm", f"{p.major}.{p.minor}", "SMs", p.multi_processor_count)
for mod in ("wrapt", "pytest", "pytest_timeout", "cupy", "vllm"):
    try:
        m = __import__(mod)
        print(mod, getattr(m, "__version__", "?"), "at", getattr(m, "__file__", "?"))
    except Exception as exc:  # noqa: BLE001
        print(mod, "not importable:", type(exc).__name__)
PYEOF

# 3. Can torch use the GPU?
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
  no_gpu_or_fail "torch $("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null) cannot use it: \
torch.cuda.is_available() is False"
fi

left() { echo $((T0 + BUDGET_S - $(date +%s))); }
run_part() {  # run_part NAME LIMIT LOG CMD...: runs CMD under min(LIMIT, what is left); records rc and seconds
  local name=$1 limit=$2 log=$3
  shift 3
  local l
  l=$(left)
  ((l - 5 < limit)) && limit=$((l - 5))
  R[$name.limit_s]=$limit
  if ((limit < 15)); then
    R[$name.rc]=skipped
    R[$name.why]="out of time: ${l}s of the ${BUDGET_S}s budget left"
    return
  fi
  local t
  t=$(date +%s)
  note "$name: $* (limit ${limit}s)"
  timeout -k 10 "$limit" "$@" >>"$log" 2>&1
  R[$name.rc]=$?
  R[$name.seconds]=$(($(date +%s) - t))
}

# 4. The parts.
: >"$OUT/pytest_gpu.log"
pytest_args=(-m gpu -q -rs -p no:cacheprovider --junitxml="$OUT/pytest_gpu.xml")
if "$PY" -c 'import pytest_timeout' >/dev/null 2>&1; then
  pytest_args+=(--timeout 100)  # one stuck test fails alone; the run still writes its XML
fi
export CAMP2P_GPU_CHILD_TIMEOUT_S=${CAMP2P_GPU_CHILD_TIMEOUT_S:-45}  # 4 child processes: 180 s < 240 s
# The files that hold gpu-marked tests: collecting the whole suite would
# import modules that need what the box lacks (vLLM, grimp).
mapfile -t gpu_files < <(grep -rl -E 'mark\.gpu' --include='test_*.py' tests | sort)
R[pytest.files]=${#gpu_files[@]}
if ((${#gpu_files[@]})); then
  run_part pytest "${PYTEST_LIMIT:-240}" "$OUT/pytest_gpu.log" "$PY" -m pytest "${pytest_args[@]}" "${gpu_files[@]}"
else
  R[pytest.rc]="no test file with gpu-marked tests found"
fi
CLI=("$PY" -m camp2p_overlap.tools.cli)
run_part bench "${BENCH_LIMIT:-60}" "$OUT/tools.log" "${CLI[@]}" bench --device cuda --scenario gpu-ffn-bound \
  --comm-cores "${BENCH_COMM_CORES:-8}" --no-progress --json "$OUT/bench_cuda.json"
run_part sweep "${SWEEP_LIMIT:-110}" "$OUT/tools.log" "${CLI[@]}" sweep --device cuda --scenario gpu-ffn-bound \
  --layers 4 --steps 4 --warmup 1 --reps 2 --ratios 0.5,1.5 --stage-counts 2 --comm-core-points 0,8,32,96 \
  --work-tokens none --no-progress --json "$OUT/sweep_cuda.json"
run_part overhead "${OVERHEAD_LIMIT:-40}" "$OUT/tools.log" "${CLI[@]}" overhead \
  --ab-rounds "${OVERHEAD_AB_ROUNDS:-20}" --json "$OUT/overhead.json"

failed=()
for p in pytest bench sweep overhead; do
  rc=${R[$p.rc]:-missing}
  [[ $rc == 0 ]] || failed+=("$p rc=$rc")
done
if ((${#failed[@]})); then
  finish failed "parts not passed: ${failed[*]} (124: time limit; skipped: out of budget)"
fi
finish passed "gpu tests, bench, sweep and overhead passed on cuda"
