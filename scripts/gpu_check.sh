#!/usr/bin/env bash
# GPU validation of camp2p-overlap on one CUDA GPU, in under 8 minutes.
#
#   OUT=./out bash scripts/gpu_check.sh
#
# Made for a GPU box with no network and no vLLM (Python 3.12, a CUDA torch,
# an unknown wrapt). Set-up, offline:
#   * wheels carried in $WHEELS (default ./.whl; scripts/gpu_wheels.sh fetches
#     wrapt>=2.5 and a pinned setuptools that meets pyproject.toml's
#     [build-system] requires) are installed with --target into $SITE
#     (default /tmp/camp2p-site), which goes first on PYTHONPATH;
#   * the setuptools the build will use is checked against pyproject.toml's
#     build requirement (the summary's setup.setuptools says which one, where
#     from, and whether it meets it);
#   * the project is installed with pip install --no-deps --no-build-isolation
#     --no-index -e . (PIP_BREAK_SYSTEM_PACKAGES=1: a system Python 3.12 may
#     be marked externally managed), and `import camp2p_overlap` is checked
#     from outside the checkout without the checkout on PYTHONPATH, so the
#     install is really what is imported. Only if it fails is the checkout
#     put on PYTHONPATH; the summary then says so in setup.install,
#     setup.import_via and its warnings (and the final reason). The patch
#     manifests are read as the package camp2p_overlap.patches, the
#     checkout's link to ./patches, either way.
# Time: one budget, $GPU_CHECK_BUDGET_S (default 450 s), from the start. The
# set-up (pip, 3-4 cold `import torch`) takes 20-60 s and has no limit of its
# own, so the part limits add up to 360 s, leaving SETUP_ALLOWANCE_S=60 and
# the reserves below. Each part's limit is clipped, when it starts, to what
# is left of the budget less KILL_GRACE_S (15 s) and END_RESERVE_S (10 s): a
# part cut at its limit gets SIGINT (pytest then still writes its JUnit XML
# and its summary of failures), and SIGKILL KILL_GRACE_S later if it has not
# stopped; END_RESERVE_S is for the summary. A part whose clipped limit is
# below the smaller of its own limit and 15 s is skipped (out of time).
# Both layouts run on the GPU: compute-side (the default: A2E/E2A on the
# caller's stream, the FFN on the runner's side stream F) and comm-side (A2E/E2A
# on per-stage side streams K_s), eagerly and captured with CUDA graphs.
#   1. pytest -m gpu on the test files with gpu-marked tests (bitwise, device
#      trace, the attention peer on the device, SMs held by comm kernels, the
#      stream sanitizer, tensor ownership, CUDA graph capture incl.
#      VLLM_CAMP2P_MULTISTREAM_GRAPH=1), -v -ra: each test's outcome is in the
#      log as it ends, failures in full at the end          limit 170 s
#      (each child process 40 s: four of them; each test 100 s with pytest-timeout)
#   2. camp2p-overlap bench --device cuda --scenario gpu-ffn-bound --comm-cores-sweep 0,8
#      (every policy, both layouts fixed, with the contention model off and on, side by side)  limit 40 s
#   3. camp2p-overlap bench --device cuda --graph (the same world, every policy's step
#      captured with torch.cuda.CUDAGraph in one pool and replayed, each replay
#      compared bitwise with the eager serial step; capture memory; the bench
#      captures comm-side with its config's graph_comm_side)             limit 40 s
#   4. both layouts captured through the environment, as a vLLM worker reads it
#      (tests/programs/gpu_overlap_child.py graph-env, once per layout: the
#      capture replayed bitwise against the eager serial step). comm-side runs
#      with VLLM_CAMP2P_MULTISTREAM_GRAPH_COMM_SIDE=1, set here for that run
#      only: a decode graph captures A2E/E2A on side streams only when opted
#      in (upstream's NPU graph code keeps HCCL/CAM comm on the capture's
#      stream); compute-side needs no opt-in                            limit 35 s
#   5. camp2p-overlap sweep --device cuda (ratios, --comm-cores points)       limit 45 s
#   6. camp2p-overlap overhead --ab-pairs 20 --json $OUT/overhead.json        limit 30 s
#      (host cost per (layer, stage) and per pass-through step; the decided-serial A/B
#      and its A/A control in 20 pairs each, OVERHEAD_AB_PAIRS overrides)
# The bench and sweep parts write their JSON as they go (bench: after the
# captures, each policy and each repetition; sweep: after the calibration and
# each point; "partial": true), so a part cut at its limit leaves what it measured.
# Overrides: PYTEST_LIMIT BENCH_LIMIT GRAPH_LIMIT LAYOUTS_LIMIT SWEEP_LIMIT OVERHEAD_LIMIT GPU_CHECK_KILL_GRACE_S (s);
# BENCH_COMM_CORES_SWEEP (part 2's --comm-cores-sweep), BENCH_COMM_CORES (part 3's --comm-cores);
# GPU_CHECK_PARTS (the parts to run, e.g. "pytest bench"; the others are
# reported as not selected); GPU_CHECK_TESTS (the test files of part 1,
# instead of those found with gpu-marked tests).
# Files under $OUT (8, the most a device run hands back):
#   gpu_check.json  summary: status (passed / failed / skipped; "running"
#                   while the script runs: it is written first and after
#                   each step, so a run stopped from outside leaves the last
#                   one), reason, warnings, the set-up, the time plan, each
#                   part's exit code, time, limit, whether its limit cut it
#                   ("cut"; all such parts in "cut_by_limit") and headline;
#                   "env": nvidia-smi, python, torch, CUDA, wrapt, setuptools,
#                   pytest (kept in the summary, not a file of its own: the
#                   8 files are taken)
#   pytest_gpu.xml  JUnit XML of part 1;  pytest_gpu.log its output
#   bench_cuda.json bench_graph_cuda.json sweep_cuda.json overhead.json   parts 2-5 (--json)
#   tools.log       set-up output and the output of parts 2-6 (part 4's: one
#                   "LAYOUT layout rc=N" line per layout, read by the summary)
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
SETUP_ALLOWANCE_S=60  # what the set-up may take before part 1 (not enforced: the limits leave it)
KILL_GRACE_S=${GPU_CHECK_KILL_GRACE_S:-15}  # after SIGINT at its limit, a part has this long before SIGKILL
END_RESERVE_S=10      # kept for the summary after the last part
MIN_PART_S=15         # a part with less than min(its limit, this) left is skipped
PARTS_ALL=(pytest bench graph layouts sweep overhead)
declare -A LIMIT=(
  [pytest]=${PYTEST_LIMIT:-170}
  [bench]=${BENCH_LIMIT:-40}
  [graph]=${GRAPH_LIMIT:-40}
  [layouts]=${LAYOUTS_LIMIT:-35}
  [sweep]=${SWEEP_LIMIT:-45}
  [overhead]=${OVERHEAD_LIMIT:-30}
)
read -r -a PARTS <<<"${GPU_CHECK_PARTS:-${PARTS_ALL[*]}}"
T0=$(date +%s)
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}
export PYTHONUNBUFFERED=1
unset TORCH_CUDA_SANITIZER  # the sanitizer runs only in the tests that ask for it
for v in $(env | grep -o '^VLLM_CAMP2P_[A-Z_]*'); do unset "$v"; done
: >"$OUT/tools.log"
# The environment report goes into the summary ("env"), not into a file of $OUT.
ENV_TXT=$(mktemp "${TMPDIR:-/tmp}/camp2p-gpu-env.XXXXXX")
rm -f "$OUT/env.txt"  # from an older run of the script
# Results of each step, read by the summary; warnings for the final reason.
declare -A R=()
WARN=()

note() { echo "== $*" >>"$OUT/tools.log"; }

summary() {  # summary STATUS REASON [provisional]: write $OUT/gpu_check.json (and print its head unless provisional)
  local py=${PY:-python3}
  command -v "$py" >/dev/null 2>&1 || py=python3
  local kv=() k p
  for k in "${!R[@]}"; do kv+=("$k=${R[$k]}"); done
  local limits=()
  for p in "${PARTS_ALL[@]}"; do limits+=("$p=${LIMIT[$p]}"); done
  local warn
  warn=$(printf '%s\n' "${WARN[@]}")
  STATUS=$1 REASON=$2 PROVISIONAL=${3:-} T_TOTAL=$(($(date +%s) - T0)) BUDGET_S=$BUDGET_S OUT="$OUT" \
    LIMITS="${limits[*]}" SELECTED="${PARTS[*]}" WARNINGS="$warn" SETUP_ALLOWANCE_S=$SETUP_ALLOWANCE_S \
    KILL_GRACE_S=$KILL_GRACE_S END_RESERVE_S=$END_RESERVE_S ENV_TXT="$ENV_TXT" \
    "$py" - "${kv[@]}" <<'PYEOF' || printf '{"status": "%s", "reason": "%s"}\n' "$1" "$2" >"$OUT/gpu_check.json"
import json, os, pathlib, re, sys, xml.etree.ElementTree as ET
out = pathlib.Path(os.environ["OUT"])
r = dict(a.split("=", 1) for a in sys.argv[1:])
def num(v):
    return int(v) if v is not None and v.lstrip("-").isdigit() else v
limits = {k: int(v) for k, v in (x.split("=") for x in os.environ["LIMITS"].split())}
selected = os.environ["SELECTED"].split()
files = {"pytest": "pytest_gpu.xml", "bench": "bench_cuda.json", "graph": "bench_graph_cuda.json",
         "layouts": "tools.log", "sweep": "sweep_cuda.json", "overhead": "overhead.json"}
def part(name):
    p = {k[len(name) + 1:]: num(v) for k, v in sorted(r.items()) if k.startswith(name + ".")}
    if "cut" in p:
        p["cut"] = p["cut"] == 1
    p["file"] = files[name]
    if name not in selected:
        p["selected"] = False
    return p
s = {
    "status": os.environ["STATUS"],
    "reason": os.environ["REASON"],
    "warnings": [w for w in os.environ["WARNINGS"].splitlines() if w],
    "seconds": int(os.environ["T_TOTAL"]),
    "budget_s": int(os.environ["BUDGET_S"]),
    "plan": {
        "budget_s": int(os.environ["BUDGET_S"]),
        "limits_s": limits,
        "limits_sum_s": sum(limits.values()),
        "setup_allowance_s": int(os.environ["SETUP_ALLOWANCE_S"]),
        "kill_grace_s": int(os.environ["KILL_GRACE_S"]),
        "end_reserve_s": int(os.environ["END_RESERVE_S"]),
        "parts_selected": selected,
    },
    "gpu_seen_by_nvidia_smi": r.get("gpu_seen") == "1",
    "python": r.get("python"),
    "setup": {k[len("setup."):]: num(v) for k, v in sorted(r.items()) if k.startswith("setup.")},
    "parts": {name: part(name) for name in files},
    "cut_by_limit": [name for name in files if r.get(name + ".cut") == "1"],
}
if os.environ.get("PROVISIONAL"):
    s["running"] = r.get("now")
xml = out / "pytest_gpu.xml"
log = out / "pytest_gpu.log"
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
elif log.exists() and log.stat().st_size:
    # No XML (killed, say): the outcomes pytest -v printed as each test ended.
    seen = re.findall(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b", log.read_text(errors="replace"), re.M)
    if seen:
        outcomes = {}
        for _, o in seen:
            outcomes[o.lower()] = outcomes.get(o.lower(), 0) + 1
        s["parts"]["pytest"]["outcomes_from_log"] = outcomes
        s["parts"]["pytest"]["not_passed"] = [f"{t}: {o}" for t, o in seen if o not in ("PASSED", "SKIPPED", "XFAIL")]
def headline(b):
    h = {
        "device": b.get("device"),
        "comm_model": b.get("comm_model"),
        "attn_modeled": b.get("attn_modeled"),
        "outputs_equal": b.get("outputs_equal"),
        "ffn_bound": (b.get("measured") or {}).get("ffn_bound"),
        "floor_per_layer_us": (b.get("measured") or {}).get("floor_per_layer_us"),
        "floor_fill_drain_per_layer_us": (b.get("measured") or {}).get("floor_fill_drain_per_layer_us"),
        "layouts_compared": b.get("layouts_compared"),
        "skipped_policies": [p.get("policy") for p in b.get("skipped_policies") or [] if isinstance(p, dict)],
        "contention": [{k: r.get(k) for k in ("comm_cores", "comm_model", "policies")}
                       for r in (b.get("contention") or {}).get("runs") or []] or None,
        # Launch-bound or device-bound: host time to issue / device time (measured.launch).
        "launch": {k: ((b.get("measured") or {}).get("launch") or {}).get(k) for k in (
            "ffn_host_us", "ffn_device_us", "ffn_share", "launch_bound", "launch_bound_by")},
        "fallbacks": b.get("fallbacks"),
        "policies": {
            p.get("policy"): {
                "per_layer_us_median": (p.get("per_layer_us") or {}).get("median"),
                "layouts": p.get("layouts"),
                "speedup": p.get("speedup"),
                "eta": p.get("eta"),
                "eta_fill_drain": p.get("eta_fill_drain"),
                "engaged": p.get("engaged"),
                "outputs_equal": p.get("outputs_equal"),
                "peer_cycle_ok": p.get("peer_cycle_ok"),
                "step_launch_share": (p.get("launch") or {}).get("step_share"),
                **({"eta_ci95": p.get("eta_ci95"), "captured_variants": p.get("captured_variants"),
                    "capture_pool_bytes": (p.get("capture") or {}).get("pool_bytes"),
                    "second_variant_bytes": (p.get("capture") or {}).get("second_variant_bytes")}
                   if b.get("graph") else {}),
            }
            for p in b.get("policies", []) if isinstance(p, dict)
        },
    }
    if b.get("partial"):
        h["partial"] = b.get("progress")
    if b.get("graph"):
        gp = b.get("graph_pool") or {}
        h["graph_pool"] = {k: gp.get(k) for k in ("one_pool", "graphs")}
    return h
for name, file in (("bench", "bench_cuda.json"), ("graph", "bench_graph_cuda.json"), ("sweep", "sweep_cuda.json"),
                   ("overhead", "overhead.json")):
    f = out / file
    if not f.exists():
        continue
    try:
        data = json.loads(f.read_text())
    except Exception as exc:  # noqa: BLE001
        s["parts"][name]["json_error"] = repr(exc)
        continue
    if name in ("bench", "graph"):
        s["parts"][name]["headline"] = headline(data)
    elif name == "sweep":
        s["parts"][name]["points"] = [
            {"kind": key, **{k: pt.get(k) for k in ("target_ratio", "measured_ratio", "stages", "comm_cores",
                                                    "asked_comm_cores") if k in pt}, "headline": headline(pt["report"])}
            for key in ("ratio_points", "stage_points", "comm_core_points") for pt in data.get(key, [])
        ]
        for k in ("comm_core_limit", "comm_core_changes", "fallbacks"):
            s["parts"][name][k] = data.get(k)
        if data.get("partial"):
            s["parts"][name]["partial"] = data.get("progress")
    else:
        s["parts"][name]["result"] = {k: v for k, v in data.items() if not isinstance(v, (list, dict)) or k in (
            "engaged_us_per_layer_stage", "passthrough_us_per_step", "passthrough_us_per_call")}
        s["parts"][name]["result"]["decided_serial_ab"] = data.get("decided_serial_ab")
# Part 4: one "LAYOUT <layout> rc=<n>" line per layout, and what its child printed last.
tools_log = out / "tools.log"
if tools_log.exists():
    text = tools_log.read_text(errors="replace")
    seen = re.findall(r"^LAYOUT (\S+) rc=(\d+)$", text, re.M)
    if seen:
        s["parts"]["layouts"]["layouts"] = {name: int(rc) for name, rc in seen}
        s["parts"]["layouts"]["graph_env_ok"] = re.findall(r"^GRAPH_ENV_OK .*$", text, re.M)
env = pathlib.Path(os.environ.get("ENV_TXT") or "/nonexistent")
if env.exists():
    s["env"] = env.read_text(errors="replace").strip().splitlines()[:80]
tmp = out / "gpu_check.json.tmp"
tmp.write_text(json.dumps(s, indent=1))
tmp.replace(out / "gpu_check.json")
if not os.environ.get("PROVISIONAL"):
    print(json.dumps({k: s[k] for k in ("status", "reason", "seconds")}))
PYEOF
}

progress() {  # progress WHAT: the provisional summary (status "running")
  summary running "running: $1 (this summary is provisional until the script ends)" provisional
}

finish() {  # finish STATUS REASON: write the summary and exit with the status's code
  unset 'R[now]'
  local reason=$2
  ((${#WARN[@]})) && reason+=" (warnings: ${WARN[*]})"
  summary "$1" "$reason"
  rm -f "$ENV_TXT" "$OUT"/*.tmp  # the report is in the summary; a write cut by SIGKILL leaves no 9th file
  [[ $1 == failed ]] && exit 1
  exit 0
}
trap 'finish failed "gpu_check.sh was stopped by a signal during ${R[now]:-set-up}"' TERM HUP
R[now]=set-up
progress set-up

# 0. Does nvidia-smi see a GPU? (Then a missing or CPU-only torch is a failure, not a skip.)
gpu_seen=0
if command -v nvidia-smi >/dev/null 2>&1; then
  smi=$(nvidia-smi -L 2>&1)
  echo "nvidia-smi -L: $smi" >>"$ENV_TXT"
  grep -q '^GPU [0-9]' <<<"$smi" && gpu_seen=1
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv \
    >>"$ENV_TXT" 2>&1 || true
else
  echo "nvidia-smi: not found" >>"$ENV_TXT"
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
# The setuptools the editable install builds with (--no-build-isolation: the
# one this Python imports, a carried one first), against pyproject.toml's
# [build-system] requires. Prints "VERSION at PATH: meets REQ" or why not.
setuptools_check=$("$PY" - 2>&1 <<'PYEOF'
import re, sys
text = open("pyproject.toml", encoding="utf-8").read()
block = re.search(r"^\[build-system\][^\[]*?^requires\s*=\s*\[(.*?)\]", text, re.M | re.S)
reqs = re.findall(r"[\"']([^\"']+)[\"']", block.group(1)) if block else []
req = next((q for q in reqs if re.match(r"setuptools\b", q)), None)
try:
    import setuptools
except Exception as exc:  # noqa: BLE001
    print(f"none: setuptools is not importable ({type(exc).__name__}), needs {req}")
    sys.exit(1)
got = f"{setuptools.__version__} at {setuptools.__file__.rsplit('/', 2)[0]}"
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
if req is None:
    print(f"{got}: pyproject.toml names no setuptools build requirement")
    sys.exit(1)
if not Requirement(req).specifier.contains(setuptools.__version__, prereleases=True):
    print(f"{got}: does not meet {req}")
    sys.exit(1)
print(f"{got}: meets {req}")
PYEOF
)
setuptools_ok=$?
R[setup.setuptools]=$(tail -n 1 <<<"$setuptools_check")
if ((setuptools_ok)); then
  WARN+=("setuptools ${R[setup.setuptools]}: carry a setuptools wheel in $WHEELS (scripts/gpu_wheels.sh)")
fi
note "pip install --no-deps --no-build-isolation --no-index -e ."
pip_out=$(PIP_BREAK_SYSTEM_PACKAGES=1 "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1)
pip_rc=$?
printf '%s\n' "$pip_out" >>"$OUT/tools.log"
check_import() {  # check_import: import the package from outside the checkout; prints where it came from
  (cd / && "$PY" - 2>&1 <<'PYEOF'
import os
import camp2p_overlap
from camp2p_overlap.core.patching.manifest import load_manifests
print("camp2p_overlap", camp2p_overlap.__version__, "from", camp2p_overlap.__file__)
print("manifests", [m.name for m in load_manifests()])
print("IMPORTED_FROM", os.path.realpath(camp2p_overlap.__file__))
PYEOF
  )
}
imported_from() { sed -n 's/^IMPORTED_FROM //p' <<<"$1" | tail -n 1; }
in_checkout() { [[ $(imported_from "$1") == "$(pwd -P)/camp2p_overlap/__init__.py" ]]; }
imported=
if ((pip_rc == 0)); then
  R[setup.install]=editable
  if imported=$(check_import) && in_checkout "$imported"; then
    R[setup.import_via]="editable install"
  else
    from=$(imported_from "$imported")
    [[ -n $from ]] || from="nowhere: $(tail -n 1 <<<"$imported" | cut -c1-300)"
    R[setup.install]="editable, but outside the checkout camp2p_overlap imports from $from"
    imported=
  fi
else
  R[setup.install]="failed (pip exit $pip_rc): $(grep -v '^\s*$' <<<"$pip_out" | tail -n 1 | cut -c1-300)"
fi
if [[ -z $imported ]]; then  # the fallback: the checkout on PYTHONPATH, said in the summary
  export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
  R[setup.import_via]="PYTHONPATH=$REPO"
  WARN+=("the editable install did not take (${R[setup.install]}); the parts import the checkout through PYTHONPATH")
  if ! imported=$(check_import) || ! in_checkout "$imported"; then
    printf '%s\n' "$imported" >>"$OUT/tools.log"
    finish failed "camp2p_overlap or its patch manifests do not import from $REPO after set-up (see tools.log)"
  fi
fi
grep -E '^(camp2p_overlap|manifests) ' <<<"$imported" >>"$OUT/tools.log"
R[setup.import]=ok
R[setup.import_from]=$(imported_from "$imported")
progress "set-up done"

"$PY" - >>"$ENV_TXT" 2>&1 <<'PYEOF'
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
print("cuda available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", torch.cuda.get_device_name(0), "sm", f"{p.major}.{p.minor}", "SMs", p.multi_processor_count)
for mod in ("wrapt", "setuptools", "pip", "pytest", "pytest_timeout", "cupy", "vllm"):
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
selected() { [[ " ${PARTS[*]} " == *" $1 "* ]]; }
run_part() {  # run_part NAME LOG CMD...: CMD under its limit clipped to what is left; records rc, seconds, cut
  local name=$1 log=$2
  shift 2
  selected "$name" || return 0
  local asked=${LIMIT[$name]} l limit
  l=$(left)
  limit=$asked
  ((l - KILL_GRACE_S - END_RESERVE_S < limit)) && limit=$((l - KILL_GRACE_S - END_RESERVE_S))
  R[$name.limit_s]=$limit
  R[$name.asked_limit_s]=$asked
  R[$name.left_s]=$l
  if ((limit < (asked < MIN_PART_S ? asked : MIN_PART_S))); then
    R[$name.rc]=skipped
    R[$name.why]="out of time: ${l}s of the ${BUDGET_S}s budget left"
    progress "after $name (skipped)"
    return 0
  fi
  R[now]=$name
  progress "$name (limit ${limit}s)"
  local t rc
  t=$(date +%s)
  note "$name: $* (limit ${limit}s)"
  # SIGINT at the limit (pytest writes its XML and failures), SIGKILL KILL_GRACE_S later.
  timeout -s INT -k "$KILL_GRACE_S" "$limit" "$@" >>"$log" 2>&1
  rc=$?
  R[$name.rc]=$rc
  R[$name.seconds]=$(($(date +%s) - t))
  if ((rc == 124 || rc == 137)); then
    R[$name.cut]=1
    R[$name.why]="cut at its ${limit}s limit ($( ((rc == 124)) && echo SIGINT || echo "SIGKILL after SIGINT and ${KILL_GRACE_S}s"))"
  else
    R[$name.cut]=0
  fi
  unset 'R[now]'
  progress "after $name"
}

# 4. The parts.
: >"$OUT/pytest_gpu.log"
# -v: each test's outcome in the log as it ends (kept if the run is killed);
# -ra: the summary of every test not passed; full tracebacks (the default).
pytest_args=(-m gpu -v -ra --durations=10 -p no:cacheprovider --junitxml="$OUT/pytest_gpu.xml")
if "$PY" -c 'import pytest_timeout' >/dev/null 2>&1; then
  pytest_args+=(--timeout 100)  # one stuck test fails alone; the run still writes its XML
fi
export CAMP2P_GPU_CHILD_TIMEOUT_S=${CAMP2P_GPU_CHILD_TIMEOUT_S:-40}  # 4 child processes: 160 s < 190 s
if [[ -n ${GPU_CHECK_TESTS:-} ]]; then
  read -r -a gpu_files <<<"$GPU_CHECK_TESTS"
else
  # The files that hold gpu-marked tests: collecting the whole suite would
  # import modules that need what the box lacks (vLLM, grimp).
  mapfile -t gpu_files < <(grep -rl -E 'mark\.gpu' --include='test_*.py' tests | sort)
fi
R[pytest.files]=${#gpu_files[@]}
if ((${#gpu_files[@]})); then
  run_part pytest "$OUT/pytest_gpu.log" "$PY" -m pytest "${pytest_args[@]}" "${gpu_files[@]}"
elif selected pytest; then
  R[pytest.rc]="no test file with gpu-marked tests found"
fi
CLI=("$PY" -m camp2p_overlap.tools.cli)
run_part bench "$OUT/tools.log" "${CLI[@]}" bench --device cuda --scenario gpu-ffn-bound \
  --comm-cores-sweep "${BENCH_COMM_CORES_SWEEP:-0,8}" --no-progress --json "$OUT/bench_cuda.json"
run_part graph "$OUT/tools.log" "${CLI[@]}" bench --device cuda --scenario gpu-ffn-bound --graph \
  --comm-cores "${BENCH_COMM_CORES:-8}" --no-progress --json "$OUT/bench_graph_cuda.json"
# Part 4: each layout captured from the environment's configuration. The comm-side run sets
# VLLM_CAMP2P_MULTISTREAM_GRAPH_COMM_SIDE=1 explicitly: without it the layer refuses to capture A2E/E2A on
# side streams (upstream's NPU graph code keeps HCCL on the capture's stream) and records the serial graph.
graph_layouts() {  # graph_layouts PY: the child once per layout; fails when either fails
  local py=$1 rc=0 one
  local common=(VLLM_CAMP2P_MULTISTREAM=1 VLLM_CAMP2P_MULTISTREAM_GRAPH=1 VLLM_CAMP2P_MULTISTREAM_BACKEND=cuda
    VLLM_CAMP2P_MULTISTREAM_ADAPTIVE=0)
  env "${common[@]}" "$py" tests/programs/gpu_overlap_child.py graph-env
  one=$?
  echo "LAYOUT compute-side rc=$one"
  ((one)) && rc=1
  env "${common[@]}" VLLM_CAMP2P_MULTISTREAM_LAYOUT=comm-side VLLM_CAMP2P_MULTISTREAM_GRAPH_COMM_SIDE=1 \
    "$py" tests/programs/gpu_overlap_child.py graph-env
  one=$?
  echo "LAYOUT comm-side rc=$one"
  ((one)) && rc=1
  return $rc
}
export -f graph_layouts
run_part layouts "$OUT/tools.log" bash -c 'graph_layouts "$1"' graph_layouts "$PY"
run_part sweep "$OUT/tools.log" "${CLI[@]}" sweep --device cuda --scenario gpu-ffn-bound \
  --layers 4 --steps 4 --warmup 1 --reps 2 --ratios 0.5,1.5 --stage-counts 2 --comm-core-points 0,8,32,96 \
  --work-tokens none --no-progress --json "$OUT/sweep_cuda.json"
run_part overhead "$OUT/tools.log" "${CLI[@]}" overhead \
  --ab-pairs "${OVERHEAD_AB_PAIRS:-20}" --json "$OUT/overhead.json"

failed=()
cut=()
for p in "${PARTS[@]}"; do
  rc=${R[$p.rc]:-missing}
  [[ $rc == 0 ]] || failed+=("$p rc=$rc")
  [[ ${R[$p.cut]:-0} == 1 ]] && cut+=("$p")
done
only=
[[ "${PARTS[*]}" == "${PARTS_ALL[*]}" ]] || only=" (parts selected: ${PARTS[*]})"
if ((${#failed[@]})); then
  why="parts not passed: ${failed[*]}"
  ((${#cut[@]})) && why+="; cut by their time limit: ${cut[*]}"
  finish failed "$why (124: cut at the time limit, 137: killed after it; skipped: out of budget)$only"
fi
if [[ -n $only ]]; then
  finish passed "the selected parts passed on cuda: ${PARTS[*]}"
fi
finish passed "gpu tests, bench, graph bench, both layouts' graphs, sweep and overhead passed on cuda"
