#!/usr/bin/env bash
# The prepared GPU check: on a machine with CUDA, a preinstalled torch and no network, install
# tierstore from a folder of wheels, run the CUDA tests and the optimizer and swap benchmarks on
# the GPU, and write logs and JSON results, all within about 8 minutes.
#
#   benchmarks/gpu_check.sh --prepare DIR [--python-version 3.12]
#       (here, with network) download into DIR the wheels the GPU machine lacks: the project's
#       dependencies and test tools except torch and what torch brings, and except matplotlib
#       (imported only by the demo's and the simulator's plots, which the check does not draw).
#   benchmarks/gpu_check.sh [--wheels DIR] [--out DIR] [--allow-cpu] [--budget SECONDS]
#       (there, offline) install what is missing from DIR without an index, print versions and
#       the GPU, run `pytest -m gpu`, bench_optim --quick and bench_swap --quick; each stage has
#       its own time limit; a failed stage does not stop the next; the exit code is 0 only if
#       every stage passed (1 if one did not, 2 for bad arguments, 3 for no CUDA).
#       --out defaults to $OUT if set, else benchmarks/results/gpu/. Without CUDA it stops,
#       unless --allow-cpu: then the same stages run on the CPU under TIERSTORE_EMULATE_DEVICE=1
#       (the CUDA tests skip), which is how the check is tested off a GPU.
#
# Environment: PYTHON (default python3) is the interpreter with torch.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SELF="$ROOT/benchmarks/gpu_check.sh"
PY="${PYTHON:-python3}"
# Seconds each stage may take, within the budget for all of them (8 minutes less a margin).
BUDGET=470
LIMITS=(install:60 versions:20 tests:170 bench_optim:90 bench_swap:130)

usage() {
    sed -n '2,19p' "$SELF" | sed 's/^# \{0,1\}//'
}

die() {  # bad arguments: exit 2, as argparse does
    echo "gpu_check: $*" >&2
    exit 2
}

# --------------------------------------------------------------------------------------------
# --prepare: download wheels (runs where the package registry is reachable)
# --------------------------------------------------------------------------------------------

requirements() {
    # The project's dependencies and test tools, less torch (preinstalled on the GPU machine,
    # with the filelock, typing-extensions, sympy, networkx, jinja2, fsspec and setuptools<82 it
    # requires) and matplotlib (plots only, imported lazily), plus setuptools>=68, which
    # pyproject's build-system asks for (an editable install without build isolation uses the
    # one installed). numpy is shipped although it is usually there.
    "$PY" - "$ROOT/pyproject.toml" <<'EOF'
import re, sys
text = open(sys.argv[1], encoding="utf-8").read()
try:
    import tomllib
    project = tomllib.loads(text)["project"]
    core = project["dependencies"]
    dev = project.get("optional-dependencies", {}).get("dev", [])
except ModuleNotFoundError:  # Python 3.10: read the two arrays by hand
    def array(name):
        match = re.search(r"^" + name + r"\s*=\s*\[(.*?)\]", text, re.S | re.M)
        return re.findall(r'"([^"]+)"', match.group(1)) if match else []
    core, dev = array("dependencies"), array("dev")
def name(spec):
    return re.split(r"[<>=!~;\[ ]", spec, maxsplit=1)[0].strip().lower()
wanted = [s for s in core if name(s) not in {"torch", "matplotlib"}]
wanted += [s for s in dev if name(s) in {"pytest", "pytest-asyncio", "hypothesis"}]
wanted.append("setuptools>=68")
print("\n".join(wanted))
EOF
}

prepare() {
    local dir="$1" pyver="$2"
    [[ "$pyver" =~ ^3\.[0-9]+$ ]] || die "--python-version takes 3.N, not '$pyver'"
    mkdir -p "$dir" || die "cannot create $dir"
    local reqs
    # The wheel of setuptools is one torch 2.11 accepts (<82); installing it is left to pip:
    # only where setuptools is missing or older than 68.
    reqs="$(requirements)" || die "cannot read the dependencies from pyproject.toml"
    printf '%s\n' "$reqs" >"$dir/requirements.txt"
    echo "gpu_check --prepare: wheels for CPython $pyver, Linux x86_64, into $dir, for:"
    sed 's/^/  /' "$dir/requirements.txt"
    "$PY" -m pip download --disable-pip-version-check --progress-bar off --only-binary=:all: \
        --python-version "$pyver" --implementation cp --abi "cp${pyver/./}" --abi abi3 --abi none \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_12_x86_64 --platform manylinux2010_x86_64 --platform manylinux_2_5_x86_64 \
        --platform manylinux1_x86_64 --platform any \
        -d "$dir" -r "$dir/requirements.txt" "setuptools<82" || { echo "gpu_check --prepare: pip download failed" >&2; exit 1; }
    local kib
    kib="$(du -sk "$dir" | cut -f1)"
    echo "gpu_check --prepare: $(find "$dir" -name '*.whl' | wc -l) wheels, $((kib / 1024)) MiB in $dir"
    if ((kib > 48 * 1024)); then
        echo "gpu_check --prepare: WARNING: over 48 MiB; a device run carries at most 64 MiB of ignored paths" >&2
    fi
}

# --------------------------------------------------------------------------------------------
# The stages (each runs in a child process of this script: `--run-stage NAME`, so that
# `timeout` ends it with everything it started; the parent exports MODE OUTDIR WHEELS SCRATCH PY)
# --------------------------------------------------------------------------------------------

stage_install() {
    # Into the interpreter's environment; where the system manages that one (PEP 668), into a
    # venv that sees the system's packages (torch included), which later stages then use.
    local pip=("$PY" -m pip install --disable-pip-version-check --no-input --progress-bar off)
    if [[ -n "$WHEELS" ]]; then
        local reqs="$WHEELS/requirements.txt" log rc
        [[ -f "$reqs" ]] || { echo "no requirements.txt in $WHEELS (--prepare writes it)"; return 1; }
        log="$("${pip[@]}" --no-index --find-links "$WHEELS" -r "$reqs" 2>&1)"
        rc=$?
        echo "$log"
        if ((rc != 0)) && grep -q "externally-managed-environment" <<<"$log"; then
            local venv="$SCRATCH/venv"
            echo "the system manages $PY's packages: installing into a venv over them, $venv"
            "$PY" -m venv --system-site-packages "$venv" || return 1
            PY="$venv/bin/python"
            echo "$PY" >"$SCRATCH/python"
            pip=("$PY" -m pip install --disable-pip-version-check --no-input --progress-bar off)
            "${pip[@]}" --no-index --find-links "$WHEELS" -r "$reqs" || return 1
        elif ((rc != 0)); then
            return 1
        fi
    else
        echo "no --wheels: using the dependencies already installed"
    fi
    "${pip[@]}" --no-index --no-deps --no-build-isolation -e "$ROOT" || return 1
    "$PY" - <<'EOF'
import importlib
names = ("tierstore", "policies", "numpy", "zarr", "lmdb", "crc32c", "aiofiles", "tqdm", "psutil",
         "pytest", "pytest_asyncio", "hypothesis")
for name in names:
    importlib.import_module(name)
print(f"all {len(names)} modules the check needs import")
EOF
}

stage_versions() {
    "$PY" - "$OUTDIR/versions.json" "$MODE" <<'EOF'
import json, os, platform, sys
from importlib import metadata
import torch
info = {"mode": sys.argv[2], "python": platform.python_version(), "torch": torch.__version__,
        "torch_cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
        "cpus": os.cpu_count(), "emulate_device": os.environ.get("TIERSTORE_EMULATE_DEVICE")}
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    info["gpu"] = {"name": p.name, "capability": f"{p.major}.{p.minor}", "memory_gib": round(p.total_memory / 2**30, 1),
                   "count": torch.cuda.device_count()}
packages = {}
for name in ("tierstore", "numpy", "zarr", "lmdb", "crc32c", "aiofiles", "tqdm", "psutil", "pytest",
             "pytest-asyncio", "hypothesis", "setuptools", "matplotlib"):
    try:
        packages[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
        packages[name] = None
info["packages"] = packages
for key, value in info.items():
    print(f"{key:>14}: {value}")
with open(sys.argv[1], "w") as f:
    json.dump(info, f, indent=2)
EOF
    local rc=$?
    if command -v nvidia-smi >/dev/null; then
        timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,utilization.gpu,temperature.gpu --format=csv
    else
        echo "nvidia-smi: not found"
    fi
    return $rc
}

stage_tests() {
    "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider --junitxml="$OUTDIR/tests.xml" tests
}

stage_bench() {
    local script="$1" extra=()
    # The benchmarks run on the GPU only if they take --device; without it they run on the CPU.
    if [[ "$MODE" == "cuda" ]]; then
        if "$PY" "benchmarks/$script.py" --help 2>/dev/null | grep -q -- "--device"; then
            extra=(--device cuda)
        else
            echo "NOTE: $script has no --device option: it ran on the CPU" | tee -a "$OUTDIR/notes.txt"
        fi
    fi
    "$PY" "benchmarks/$script.py" --quick --json "$OUTDIR/$script.json" --dir "$SCRATCH/$script" "${extra[@]}"
}

if [[ "${1:-}" == "--run-stage" ]]; then
    cd "$ROOT" || exit 2
    [[ -f "$SCRATCH/python" ]] && PY="$(cat "$SCRATCH/python")"
    case "${2:-}" in
        install) stage_install ;;
        versions) stage_versions ;;
        tests) stage_tests ;;
        bench_optim|bench_swap) stage_bench "$2" ;;
        *) die "no stage '${2:-}'" ;;
    esac
    exit $?
fi

# --------------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------------

WHEELS=""
OUTDIR="${OUT:-$ROOT/benchmarks/results/gpu}"
ALLOW_CPU=0
PREPARE=""
PYVER="3.12"
while (($#)); do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --prepare) (($# >= 2)) || die "--prepare needs a folder"; PREPARE="$2"; shift 2 ;;
        --python-version) (($# >= 2)) || die "--python-version needs a value"; PYVER="$2"; shift 2 ;;
        --wheels) (($# >= 2)) || die "--wheels needs a folder"; WHEELS="$2"; shift 2 ;;
        --out) (($# >= 2)) || die "--out needs a folder"; OUTDIR="$2"; shift 2 ;;
        --allow-cpu) ALLOW_CPU=1; shift ;;
        --budget)
            (($# >= 2)) || die "--budget needs a number of seconds"
            [[ "$2" =~ ^[0-9]+$ ]] && (($2 > 0)) || die "--budget takes a positive number of seconds, not '$2'"
            BUDGET="$2"; shift 2 ;;
        *) die "unknown argument '$1' (see --help)" ;;
    esac
done

if [[ -n "$PREPARE" ]]; then
    [[ -z "$WHEELS" ]] || die "--prepare and --wheels do not go together"
    prepare "$PREPARE" "$PYVER"
    exit 0
fi
[[ -z "$WHEELS" || -d "$WHEELS" ]] || die "--wheels $WHEELS is not a folder"
[[ -z "$WHEELS" ]] || WHEELS="$(cd "$WHEELS" && pwd)"

# --------------------------------------------------------------------------------------------
# The check
# --------------------------------------------------------------------------------------------

"$PY" -c 'import torch' 2>/dev/null || die "$PY cannot import torch: the check uses the torch installed (set PYTHON=...)"
if "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    MODE="cuda"
    unset TIERSTORE_EMULATE_DEVICE TIERSTORE_EMULATE_LINK
else
    if ((!ALLOW_CPU)); then
        echo "gpu_check: no CUDA here (torch.cuda.is_available() is False); --allow-cpu runs the same stages on the CPU under TIERSTORE_EMULATE_DEVICE=1" >&2
        exit 3
    fi
    MODE="cpu-emulated"
    export TIERSTORE_EMULATE_DEVICE=1
    echo "gpu_check: NO CUDA here: the stages run on the CPU under TIERSTORE_EMULATE_DEVICE=1 (the CUDA tests skip)"
fi

mkdir -p "$OUTDIR" || die "cannot create --out $OUTDIR"
OUTDIR="$(cd "$OUTDIR" && pwd)"
rm -f "$OUTDIR/notes.txt"
SCRATCH="$(mktemp -d "${TMPDIR:-/tmp}/tierstore-gpu-check.XXXXXX")"
trap 'rm -rf "$SCRATCH"' EXIT
cd "$ROOT" || exit 2
export MODE OUTDIR WHEELS SCRATCH PY PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
# The tree stays importable even if the editable install cannot run (no pip, say).
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
echo "gpu_check: mode $MODE, $PY, output in $OUTDIR, budget ${BUDGET}s"

STARTED=$SECONDS
NAMES=() STATES=() TIMES=()

# stage NAME LIMIT: run it with a time limit (cut to what the budget has left), output to the
# terminal and to $OUTDIR/NAME.log; record passed / FAILED / TIMEOUT / not run.
stage() {
    local name="$1" limit="$2" n=$((${#NAMES[@]} + 1))
    local left=$((BUDGET - (SECONDS - STARTED)))
    ((left < limit)) && limit=$left
    if ((limit < 5)); then
        echo "== [$n/${#LIMITS[@]}] $name: not run, the ${BUDGET}s budget is spent"
        NAMES+=("$name") STATES+=("not run (budget)") TIMES+=(0)
        return
    fi
    echo "== [$n/${#LIMITS[@]}] $name (limit ${limit}s, $((SECONDS - STARTED))s so far)"
    local t0=$SECONDS rc state="passed"
    timeout -k 10 "$limit" bash "$SELF" --run-stage "$name" 2>&1 | tee "$OUTDIR/$name.log"
    rc=${PIPESTATUS[0]}
    if ((rc == 124 || rc == 137)); then
        state="TIMEOUT after ${limit}s"
    elif ((rc != 0)); then
        state="FAILED (exit $rc)"
    fi
    echo "== [$n/${#LIMITS[@]}] $name: $state in $((SECONDS - t0))s"
    NAMES+=("$name") STATES+=("$state") TIMES+=($((SECONDS - t0)))
}

for entry in "${LIMITS[@]}"; do
    stage "${entry%%:*}" "${entry##*:}"
    [[ -f "$SCRATCH/python" ]] && PY="$(cat "$SCRATCH/python")" && export PY
done

failed=0
{
    printf '{"mode": "%s", "seconds": %d, "budget": %d, "stages": [' "$MODE" $((SECONDS - STARTED)) "$BUDGET"
    for i in "${!NAMES[@]}"; do
        ((i)) && printf ', '
        printf '{"stage": "%s", "result": "%s", "seconds": %d}' "${NAMES[$i]}" "${STATES[$i]}" "${TIMES[$i]}"
    done
    printf ']}\n'
} >"$OUTDIR/summary.json"
echo
echo "gpu_check summary (mode $MODE, $((SECONDS - STARTED))s in all, budget ${BUDGET}s):"
for i in "${!NAMES[@]}"; do
    printf '  %-12s %-24s %4ss\n' "${NAMES[$i]}" "${STATES[$i]}" "${TIMES[$i]}"
    [[ "${STATES[$i]}" == "passed" ]] || failed=1
done
if [[ -f "$OUTDIR/tests.log" ]]; then
    echo "  tests: $(grep -E '[0-9]+ (passed|failed|skipped|deselected|error)|no tests ran' "$OUTDIR/tests.log" | tail -n 1)"
fi
[[ "$MODE" == "cuda" ]] || echo "  NO CUDA: this ran on the CPU under TIERSTORE_EMULATE_DEVICE=1; the CUDA tests skipped"
[[ -f "$OUTDIR/notes.txt" ]] && sed 's/^/  /' "$OUTDIR/notes.txt"
echo "  logs and JSON: $OUTDIR"
exit $failed
