#!/usr/bin/env bash
# A retrain at default sizes, warm against cold, from the same champion (issue #16's measurement).
#
#   bash benchmarks/retrain_warm_vs_cold.sh [WORKDIR]     # default /tmp/retrain-bench; ~40 min on two cores
#   KEDRO_ENV=smoke bash benchmarks/retrain_warm_vs_cold.sh /tmp/x   # the same at smoke sizes, minutes
#
# In a fresh clone at WORKDIR: MovieLens-100k (from the recbole wheel) split by time into the first 90%
# (the raw folder) and the newest 10% (a fresh file); `make run` and `make register` on the 90% make
# the champion (promoted by hand if the gate refuses it: there is nothing to compare a first version
# with). Then, from a snapshot of that state, a warm retrain (`make retrain`), the same file fed again
# (nothing is trained), and a cold one (`retrain.warm_start.enabled=false`). Wall times are in
# WORKDIR/out/*.time, the gate reports, node times, SID reports, training summaries and the lineage
# printout of each challenger in WORKDIR/out/{warm,cold}/.
set -euo pipefail
SRC="$(cd "$(dirname "$0")/.." && pwd)"
WORK="${1:-/tmp/retrain-bench}"
rm -rf "$WORK" && git clone -q "$SRC" "$WORK" && cd "$WORK"
OUT="$WORK/out" && mkdir -p "$OUT"
make setup > "$OUT/setup.log" 2>&1
PY=.venv/bin/python
export MLFLOW_TRACKING_URI="sqlite:///$WORK/mlflow.db"
timed() { local name=$1; shift; /usr/bin/time -f "%e s" -o "$OUT/$name.time" "$@" > "$OUT/$name.log" 2>&1; }

"$PY" - <<'EOF'
import shutil
from pathlib import Path

from diffusion_gr2.core.data.readers import classify_file
from diffusion_gr2.core.data.recbole import embedded_ml100k_folder

src, raw = embedded_ml100k_folder(), Path("data/01_raw/ml-100k")
raw.mkdir(parents=True, exist_ok=True)
for path in src.iterdir():
    if classify_file(path.name) and not path.name.endswith(".inter"):
        shutil.copy2(path, raw / path.name)
header, *rows = [line for line in (src / "ml-100k.inter").read_text().splitlines() if line.strip()]
rows.sort(key=lambda line: float(line.split("\t")[3]))
cut = int(len(rows) * 0.9)
(raw / "ml-100k.inter").write_text("\n".join([header, *rows[:cut]]) + "\n")
Path("out/fresh.inter").write_text("\n".join([header, *rows[cut:]]) + "\n")
print(f"initial: {cut} rows; fresh: {len(rows) - cut} rows from timestamp {rows[cut].split()[3]}")
EOF

timed initial .venv/bin/kedro run
timed register .venv/bin/kedro run --pipelines register
if ! "$PY" -m diffusion_gr2 registry show diffusion-gr2 | grep -q champion; then
  version=$("$PY" -m diffusion_gr2 registry show diffusion-gr2 | head -1 | sed -E 's/^diffusion-gr2 v([0-9]+).*/\1/')
  teacher=$("$PY" -m diffusion_gr2 registry show diffusion-gr2-teacher | head -1 | sed -E 's/^diffusion-gr2-teacher v([0-9]+).*/\1/')
  "$PY" -m diffusion_gr2 registry promote diffusion-gr2 "$version" --reason "first champion (benchmark)"
  "$PY" -m diffusion_gr2 registry promote diffusion-gr2-teacher "$teacher" --reason "first champion (benchmark)"
fi
mkdir -p data/01_raw/incoming
tar cf "$OUT/champion-state.tar" data mlflow.db mlruns

collect() {
  mkdir -p "$OUT/$1"
  cp -r data/08_reporting/retrain data/08_reporting/node_times.json data/08_reporting/sid_report.json \
    data/08_reporting/training "$OUT/$1/"
  "$PY" -m diffusion_gr2 lineage models:/diffusion-gr2@challenger > "$OUT/$1/lineage.txt"
  "$PY" -m diffusion_gr2 registry show > "$OUT/$1/registry.txt"
}

cp "$OUT/fresh.inter" data/01_raw/incoming/ml-100k.fresh.inter
timed warm "$PY" -m diffusion_gr2 retrain
collect warm
cp "$OUT/fresh.inter" data/01_raw/incoming/ml-100k.fresh.inter
timed refeed "$PY" -m diffusion_gr2 retrain
"$PY" -m diffusion_gr2 registry show > "$OUT/warm/registry_after_refeed.txt"

rm -rf data mlflow.db mlruns && tar xf "$OUT/champion-state.tar"
cp "$OUT/fresh.inter" data/01_raw/incoming/ml-100k.fresh.inter
timed cold .venv/bin/kedro run --pipelines retrain --params retrain.warm_start.enabled=false
collect cold
for run in initial register warm refeed cold; do echo "$run: $(cat "$OUT/$run.time")"; done
