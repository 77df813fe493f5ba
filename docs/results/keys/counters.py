"""The counters behind each arm of RESULTS 13e and 13h, summed over seeds from the runs'
results.json.

python docs/results/keys/counters.py [FOLDER]       # default: this file's folder
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root
import evaluate  # noqa: E402

folder = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent
runs = {}
for path in sorted(folder.glob("*-s[0-9]/results.json")):
    runs.setdefault(path.parent.name.rsplit("-s", 1)[0], []).append(json.loads(path.read_text()))
print(
    "| arm | attempts rejected by the post-check | gate: dropped / judged | leaked turns in kept "
    "corrections | intervened share of trained tokens |"
)
print("| --- | --- | --- | --- | --- |")
for arm, results in runs.items():
    stats = [r.get("interventions") or {} for r in results]
    if not any(stats):
        print(f"| {arm} | - | - | - | - |")
        continue
    total = evaluate.run_totals(stats)  # counts summed over seeds, rates taken again
    rejected = f"{total['attempts_rejected']} / {total['correction_attempts']}"
    gate = f"{total['gate_dropped']} / {total['gate_dropped'] + total['gate_kept']}"
    leaked = f"{total['kept_leaked_turns']} / {total['kept_corrected_turns']}"
    share = 100 * total["intervened_token_share"]
    print(f"| {arm} | {rejected} | {gate} | {leaked} | {share:.2f}% |")
