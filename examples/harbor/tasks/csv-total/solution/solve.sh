#!/bin/bash
set -euo pipefail
python - <<'PY'
import csv, json, os
rows = list(csv.DictReader(open(os.environ["ORDERS_FILE"])))
json.dump({"orders": len(rows), "total": round(sum(float(r["amount"]) for r in rows), 2)}, open("/app/total.json", "w"))
PY
